# `cmake --install build --prefix P` puts Tessera's libraries, headers, programs and a
# CMake package under P, so another project can
#   find_package(Tessera REQUIRED)
#   target_link_libraries(app PRIVATE tessera::tessera)
# (examples/ is such a project; a test builds and runs it against an install.)
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

get_property(TESSERA_APPS GLOBAL PROPERTY TESSERA_APP_TARGETS)
install(TARGETS tessera ${TESSERA_LIBRARY_TARGETS} EXPORT TesseraTargets
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
