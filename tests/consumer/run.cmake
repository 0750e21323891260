# Installs the qkv build tree into a scratch prefix, extracts the C++ example
# from README.md, builds it as a separate project with find_package(qkv), and
# runs it. Variables: QKV_SOURCE_DIR, QKV_BINARY_DIR, WORK_DIR, CXX_COMPILER,
# CXX_FLAGS, LINKER_FLAGS.
cmake_minimum_required(VERSION 3.22)

function(run_step what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${what} failed (${rc}):\n${out}\n${err}")
  endif()
  set(step_output "${out}" PARENT_SCOPE)
endfunction()

file(REMOVE_RECURSE "${WORK_DIR}")
run_step("install" ${CMAKE_COMMAND} --install "${QKV_BINARY_DIR}" --prefix "${WORK_DIR}/prefix")

# The example is the first ```cpp block after the marker comment in README.md.
file(READ "${QKV_SOURCE_DIR}/README.md" readme)
string(FIND "${readme}" "<!-- readme-example -->" marker)
if(marker EQUAL -1)
  message(FATAL_ERROR "README.md has no <!-- readme-example --> marker")
endif()
string(SUBSTRING "${readme}" ${marker} -1 rest)
string(FIND "${rest}" "```cpp\n" begin)
string(FIND "${rest}" "\n```\n" end)
if(begin EQUAL -1 OR end EQUAL -1 OR end LESS begin)
  message(FATAL_ERROR "README.md: no ```cpp block after the example marker")
endif()
math(EXPR begin "${begin} + 7")
math(EXPR length "${end} - ${begin} + 1")
string(SUBSTRING "${rest}" ${begin} ${length} example)
file(WRITE "${WORK_DIR}/readme_example.cpp" "${example}")

run_step("configure consumer" ${CMAKE_COMMAND} -S "${QKV_SOURCE_DIR}/tests/consumer"
         -B "${WORK_DIR}/build" -G Ninja
         "-DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix"
         "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}"
         "-DCMAKE_CXX_FLAGS=${CXX_FLAGS}"
         "-DCMAKE_EXE_LINKER_FLAGS=${LINKER_FLAGS}"
         "-DQKV_EXAMPLE_SOURCE=${WORK_DIR}/readme_example.cpp")
run_step("build consumer" ${CMAKE_COMMAND} --build "${WORK_DIR}/build")
run_step("run the README example" "${WORK_DIR}/build/readme_example")
message(STATUS "README example output:\n${step_output}")
