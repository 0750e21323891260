# Runs a command, prints its output (stdout and stderr together) and writes
# it to a file, and fails when the command fails: a test whose output other
# tests then check (their FIXTURES_REQUIRED names this one's
# FIXTURES_SETUP), so that one run of a slow command serves several checks.
#
#   cmake -DOUTPUT=FILE -P run_saving_output.cmake -- COMMAND [ARG...]
#
# (An argument may not contain ';', which a CMake list cannot hold.)
cmake_minimum_required(VERSION 3.22)

set(command "")
set(after_separator FALSE)
math(EXPR last "${CMAKE_ARGC} - 1")
foreach(i RANGE ${last})
  if(after_separator)
    if(CMAKE_ARGV${i} MATCHES ";")
      message(FATAL_ERROR "run_saving_output.cmake: an argument contains ';': ${CMAKE_ARGV${i}}")
    endif()
    list(APPEND command "${CMAKE_ARGV${i}}")
  elseif(CMAKE_ARGV${i} STREQUAL "--")
    set(after_separator TRUE)
  endif()
endforeach()
if(NOT OUTPUT OR NOT command)
  message(FATAL_ERROR "usage: cmake -DOUTPUT=FILE -P run_saving_output.cmake -- COMMAND [ARG...]")
endif()

file(REMOVE "${OUTPUT}")
execute_process(COMMAND ${command} OUTPUT_VARIABLE output ERROR_VARIABLE output
                RESULT_VARIABLE status)
file(WRITE "${OUTPUT}" "${output}")
message("${output}")
if(NOT status EQUAL 0)
  message(FATAL_ERROR "exit status ${status}: ${command}")
endif()
