// libtessera.so's own translation unit. The shared library is every folder's static
// library linked whole (cmake/TesseraInstall.cmake); this file gives it the one symbol
// that is its own: the version it was built as, for programs that load it at run time.
extern "C" const char* tessera_version() { return TESSERA_VERSION; }
