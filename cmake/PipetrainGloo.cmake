# Whether to build the gloo transport, after find_package(Torch). Sets PIPETRAIN_WITH_GLOO (ON/OFF), and
# PIPETRAIN_GLOO_INCLUDE_DIR when the headers are not on the default paths.
#
# transport_gloo.cpp includes c10d's ProcessGroupGloo.hpp, which includes Gloo's own headers; those must be
# the headers of the Gloo compiled into this LibTorch, or the two disagree on Gloo's classes without a
# word (a silent ABI mismatch). Two cases are certain:
#   1. the LibTorch ships Gloo's headers itself (<torch include dir>/gloo/...);
#   2. the LibTorch links a shared libgloo (libtorch_cpu.so needs libgloo.so.N, as Debian's does), and
#      Gloo's headers sit in the same prefix as that library (Debian: libgloo-dev, of the same source
#      package as the libgloo it links).
# Anything else, e.g. pip's PyTorch (Gloo linked in statically, no headers shipped), leaves the transport
# out under AUTO, with a note; PIPETRAIN_GLOO=ON then stops with the reason, OFF leaves it out anyway.
set(PIPETRAIN_WITH_GLOO OFF)
set(PIPETRAIN_GLOO_INCLUDE_DIR "")
set(_gloo_why "")

if(PIPETRAIN_GLOO STREQUAL "OFF")
  set(_gloo_why "PIPETRAIN_GLOO=OFF")
else()
  # Case 1: headers inside the LibTorch (not a system folder such as /usr/include, where a LibTorch
  # installed by the distribution shares its headers with everything else: that is case 2).
  foreach(_dir ${TORCH_INCLUDE_DIRS})
    if(EXISTS "${_dir}/gloo/config.h" AND NOT _dir IN_LIST CMAKE_CXX_IMPLICIT_INCLUDE_DIRECTORIES)
      set(PIPETRAIN_WITH_GLOO ON)
      set(PIPETRAIN_GLOO_INCLUDE_DIR "${_dir}")
      set(_gloo_how "its own headers (${_dir}/gloo)")
      break()
    endif()
  endforeach()
  # Case 2: a shared libgloo, and its headers in the same prefix.
  if(NOT PIPETRAIN_WITH_GLOO)
    get_filename_component(_torch_lib_dir "${TORCH_LIBRARY}" DIRECTORY)
    set(_torch_cpu "${_torch_lib_dir}/libtorch_cpu.so")
    if(NOT EXISTS "${_torch_cpu}")
      set(_torch_cpu "${TORCH_LIBRARY}")
    endif()
    set(_needed "")
    if(CMAKE_OBJDUMP AND EXISTS "${_torch_cpu}")
      execute_process(COMMAND ${CMAKE_OBJDUMP} -p "${_torch_cpu}" OUTPUT_VARIABLE _dynamic ERROR_QUIET)
      string(REGEX MATCH "NEEDED +libgloo\\.so[.0-9]*" _needed "${_dynamic}")
      string(REGEX REPLACE "NEEDED +" "" _needed "${_needed}")
    endif()
    if(_needed)
      find_library(PIPETRAIN_GLOO_LIBRARY NAMES ${_needed} gloo)
      find_path(PIPETRAIN_GLOO_HEADERS gloo/config.h)
      if(PIPETRAIN_GLOO_LIBRARY AND PIPETRAIN_GLOO_HEADERS)
        # The library's prefix (lib/ or lib/<multiarch>/ below it) must hold the headers.
        get_filename_component(_lib_prefix "${PIPETRAIN_GLOO_LIBRARY}" DIRECTORY)
        get_filename_component(_hdr_prefix "${PIPETRAIN_GLOO_HEADERS}" DIRECTORY)
        string(FIND "${_lib_prefix}/" "${_hdr_prefix}/lib" _at)
        if(_at EQUAL 0)
          set(PIPETRAIN_WITH_GLOO ON)
          string(CONCAT _gloo_how "the shared ${_needed} it links (${PIPETRAIN_GLOO_LIBRARY}) and the headers of "
                        "that prefix (${PIPETRAIN_GLOO_HEADERS}/gloo)")
        else()
          string(CONCAT _gloo_why "this LibTorch links ${_needed} (${PIPETRAIN_GLOO_LIBRARY}) but the Gloo headers "
                        "found (${PIPETRAIN_GLOO_HEADERS}/gloo) belong to another prefix")
        endif()
      else()
        set(_gloo_why "this LibTorch links ${_needed}, but Gloo's headers were not found (Debian: libgloo-dev)")
      endif()
    else()
      string(CONCAT _gloo_why "this LibTorch (${Torch_DIR}) ships no Gloo headers and links no shared libgloo, "
                    "so no headers are known to match the Gloo inside it (pip's PyTorch is such a LibTorch)")
    endif()
  endif()
endif()

if(PIPETRAIN_WITH_GLOO)
  message(STATUS "pipetrain: gloo transport: ON, with ${_gloo_how}")
elseif(PIPETRAIN_GLOO STREQUAL "ON")
  message(FATAL_ERROR "pipetrain: PIPETRAIN_GLOO=ON, but ${_gloo_why}. Use PIPETRAIN_GLOO=AUTO or OFF "
                      "(the shm, mpi and local transports do not need Gloo).")
else()
  message(STATUS "pipetrain: gloo transport: OFF (${_gloo_why}); transports: shm, mpi, local")
endif()
