// The one source of the targets that own Tessera's precompiled headers
// (cmake/TesseraCompileOptions.cmake, tessera_pch_*): they compile the headers, not this.
