# QKV_HWY_THIS_CPU_ONLY: the Highway targets that the CPU running the
# configure cannot run are left out of the build (appended to
# QKV_HWY_DISABLED_TARGETS). The sanitizer preset uses it: its tests run only
# what this CPU runs, and each AVX-512 target costs as much compilation as the
# targets that run (about a quarter of a kernel file's time under ASan).
# The release build compiles every target.
set(QKV_HWY_PROBE_SOURCE ${CMAKE_CURRENT_LIST_DIR}/hwy_unsupported_targets.cpp)
function(qkv_hwy_disable_unsupported_targets out_var)
  try_run(run_result compile_result
          ${CMAKE_BINARY_DIR}/hwy_this_cpu ${QKV_HWY_PROBE_SOURCE}
          LINK_LIBRARIES hwy::hwy
          COMPILE_OUTPUT_VARIABLE compile_output
          RUN_OUTPUT_VARIABLE unsupported)
  if(NOT compile_result OR NOT run_result EQUAL 0)
    message(FATAL_ERROR "QKV_HWY_THIS_CPU_ONLY: the Highway target probe did not run "
                        "(${run_result}):\n${compile_output}")
  endif()
  string(STRIP "${unsupported}" unsupported)
  if(unsupported)
    message(STATUS "Highway targets this CPU cannot run, left out: ${unsupported}")
    string(REPLACE ")" "|${unsupported})" disabled "${${out_var}}")
    set(${out_var} "${disabled}" PARENT_SCOPE)
  endif()
endfunction()
