// Linked into fuzz_distributed ahead of libc: a dlclose that keeps every
// library loaded. MPI_Finalize unloads OpenMPI's plugins (mca_*.so), and
// OpenMPI 4.1 has no setting to keep them; memory they allocated and left
// to the process's end then shows in LeakSanitizer's exit check with its
// frames in an unknown module, which no suppression can name. Kept loaded,
// the frames name the plugins and tests/fuzz/lsan_mpi.supp covers them.
// ASan's own dlclose interceptor forwards here (the next definition after
// the executable's).
extern "C" int dlclose(void* handle) {
  (void)handle;
  return 0;
}
