# `cmake --install build --prefix P` puts Tessera's libraries, headers, programs, a CMake
# package and a pkg-config file under P:
#   P/lib/libtessera_<folder>.a   one static library per folder (tessera::<folder>)
#   P/lib/libtessera.so           all of them in one shared library (tessera::shared)
#   P/include/tessera/<folder>/   the headers; P/bin/tessera-*: the programs
#   P/lib/cmake/Tessera/          find_package(Tessera) -> tessera::tessera (static) or tessera::shared
#   P/lib/pkgconfig/tessera.pc    pkg-config --cflags --libs tessera (the shared library)
# (examples/ is such a project; a test builds and runs it against an install, both ways.)
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(TESSERA_LIBRARY_TARGETS
    tessera_common tessera_kernels tessera_diagnostics tessera_distributed tessera_dtensor tessera_optim tessera_sharding tessera_ema
    tessera_checkpoint tessera_imaging tessera_observe tessera_datasets tessera_models tessera_trainer tessera_recipes)
add_library(tessera INTERFACE)
add_library(tessera::tessera ALIAS tessera)
target_link_libraries(tessera INTERFACE ${TESSERA_LIBRARY_TARGETS})
foreach(target IN LISTS TESSERA_LIBRARY_TARGETS)
  string(REPLACE "tessera_" "" short ${target})
  set_target_properties(${target} PROPERTIES EXPORT_NAME ${short})  # tessera::<folder>
endforeach()

# libtessera.so: every folder's library linked whole. Its users get what the folders'
# headers need (their public compile definitions, LibTorch, threads); the folders'
# private dependencies (yaml-cpp, libpng, protobuf, ...) stay inside it.
add_library(tessera_shared SHARED ${PROJECT_SOURCE_DIR}/cmake/libtessera.cpp)
target_compile_definitions(tessera_shared PRIVATE TESSERA_VERSION="${PROJECT_VERSION}")
set_target_properties(tessera_shared PROPERTIES OUTPUT_NAME tessera EXPORT_NAME shared
                      VERSION ${PROJECT_VERSION} SOVERSION ${PROJECT_VERSION_MAJOR}.${PROJECT_VERSION_MINOR})
target_link_libraries(tessera_shared PRIVATE "-Wl,--whole-archive" ${TESSERA_LIBRARY_TARGETS} "-Wl,--no-whole-archive")
target_link_options(tessera_shared PRIVATE "LINKER:--no-undefined")
target_include_directories(tessera_shared INTERFACE
  $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}> $<INSTALL_INTERFACE:include/tessera> $<INSTALL_INTERFACE:include>)
set(public_definitions "")
foreach(target IN LISTS TESSERA_LIBRARY_TARGETS)
  get_target_property(definitions ${target} INTERFACE_COMPILE_DEFINITIONS)
  if(definitions)
    list(APPEND public_definitions ${definitions})
  endif()
endforeach()
list(REMOVE_DUPLICATES public_definitions)
target_compile_definitions(tessera_shared INTERFACE ${public_definitions})
target_link_libraries(tessera_shared INTERFACE Threads::Threads ${TORCH_LIBRARIES})

get_property(TESSERA_APPS GLOBAL PROPERTY TESSERA_APP_TARGETS)
install(TARGETS tessera tessera_shared ${TESSERA_LIBRARY_TARGETS} EXPORT TesseraTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(TARGETS ${TESSERA_APPS} RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
foreach(folder common kernels diagnostics distributed dtensor optim sharding ema checkpoint imaging observe datasets models trainer
               recipes)
  install(DIRECTORY ${PROJECT_SOURCE_DIR}/${folder} DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/tessera
          FILES_MATCHING PATTERN "*.h")
endforeach()

set(TESSERA_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/Tessera)
install(EXPORT TesseraTargets NAMESPACE tessera:: DESTINATION ${TESSERA_CMAKE_DIR})
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/TesseraConfig.cmake.in
                              ${PROJECT_BINARY_DIR}/TesseraConfig.cmake INSTALL_DESTINATION ${TESSERA_CMAKE_DIR})
write_basic_package_version_file(${PROJECT_BINARY_DIR}/TesseraConfigVersion.cmake COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/TesseraConfig.cmake ${PROJECT_BINARY_DIR}/TesseraConfigVersion.cmake
        DESTINATION ${TESSERA_CMAKE_DIR})

# tessera.pc, relocatable (paths relative to the file itself): the shared library, and
# LibTorch's include directories, flags and libraries, which have no pkg-config file.
function(tessera_torch_link_items out)
  set(items "")
  set(pending ${TORCH_LIBRARIES})
  set(seen "")
  while(pending)
    list(POP_FRONT pending item)
    if(item IN_LIST seen)
      continue()
    endif()
    list(APPEND seen ${item})
    if(TARGET ${item})
      get_target_property(configurations ${item} IMPORTED_CONFIGURATIONS)
      set(location "")
      if(configurations)
        list(GET configurations 0 configuration)
        get_target_property(location ${item} IMPORTED_LOCATION_${configuration})
      endif()
      if(location)
        list(APPEND items ${location})
      endif()
      get_target_property(deps ${item} INTERFACE_LINK_LIBRARIES)
      if(deps)
        list(APPEND pending ${deps})
      endif()
    elseif(item MATCHES "TARGET_(FILE|PROPERTY):([A-Za-z0-9_:]+)")
      list(APPEND pending ${CMAKE_MATCH_2})  # LibTorch's -Wl,--no-as-needed,$<TARGET_FILE:torch_cpu>
    elseif(item MATCHES "^/.*\\.so")
      list(APPEND items ${item})
    endif()
  endwhile()
  set(${out} ${items} PARENT_SCOPE)
endfunction()
tessera_torch_link_items(torch_items)
list(JOIN torch_items " " TESSERA_PC_TORCH_LIBS)
set(torch_cflags ${TORCH_CXX_FLAGS})
foreach(dir IN LISTS TORCH_INCLUDE_DIRS)
  if(NOT dir STREQUAL "/usr/include")
    list(APPEND torch_cflags "-isystem ${dir}")
  endif()
endforeach()
foreach(definition IN LISTS public_definitions)
  list(APPEND torch_cflags "-D${definition}")
endforeach()
list(JOIN torch_cflags " " TESSERA_PC_CFLAGS)
file(RELATIVE_PATH TESSERA_PC_INCLUDEDIR "/prefix/${CMAKE_INSTALL_LIBDIR}/pkgconfig" "/prefix/${CMAKE_INSTALL_INCLUDEDIR}")
configure_file(${PROJECT_SOURCE_DIR}/cmake/tessera.pc.in ${PROJECT_BINARY_DIR}/tessera.pc @ONLY)
install(FILES ${PROJECT_BINARY_DIR}/tessera.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
