# Whether to build the nccl transport (src/runtime/transport_nccl.cpp), after find_package(Torch). Sets
# PIPETRAIN_WITH_NCCL (ON/OFF), PIPETRAIN_NCCL_INCLUDE_DIR (where nccl.h is, when not on the default
# paths) and PIPETRAIN_NCCL_WHY (why it is left out, for transport_nccl_absent.cpp's message).
#
# transport_nccl.cpp includes c10d's ProcessGroupNCCL.hpp, which declares anything only with USE_C10D_NCCL
# defined and includes <nccl.h>. AUTO builds it where all of these hold:
#   1. LibTorch 2.x (the transport uses the 2.x ProcessGroupNCCL; Debian 12's 1.13 is CPU-only anyway);
#   2. a CUDA build: libtorch_cuda is next to libtorch (or the torch_cuda target exists); a CPU
#      LibTorch's headers may have ProcessGroupNCCL.hpp too (Debian's do), but not its code;
#   3. the headers have torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp;
#   4. nccl.h is found: in the LibTorch's include folders, on the default paths (Debian: libnccl-dev),
#      in pip's nvidia-nccl package next to a pip PyTorch (site-packages/nvidia/nccl/include), or in
#      PIPETRAIN_NCCL_INCLUDE_DIR.
# PIPETRAIN_NCCL=ON stops with the reason when one fails; OFF leaves the transport out.
set(PIPETRAIN_WITH_NCCL OFF)
set(PIPETRAIN_NCCL_WHY "")
set(PIPETRAIN_NCCL_INCLUDE_DIR "" CACHE PATH "Folder with nccl.h for the nccl transport (found when empty)")

if(PIPETRAIN_NCCL STREQUAL "OFF")
  set(PIPETRAIN_NCCL_WHY "PIPETRAIN_NCCL=OFF")
elseif(Torch_VERSION VERSION_LESS 2.0)
  set(PIPETRAIN_NCCL_WHY "LibTorch ${Torch_VERSION}, and the nccl transport needs a CUDA LibTorch 2.x")
else()
  get_filename_component(_torch_lib_dir "${TORCH_LIBRARY}" DIRECTORY)
  if(NOT TARGET torch_cuda AND NOT EXISTS "${_torch_lib_dir}/libtorch_cuda.so")
    set(PIPETRAIN_NCCL_WHY "LibTorch ${Torch_VERSION} at ${Torch_DIR} is a CPU build: no libtorch_cuda")
  else()
    set(_pg_header "")
    foreach(_dir ${TORCH_INCLUDE_DIRS})
      if(EXISTS "${_dir}/torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp")
        set(_pg_header "${_dir}/torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp")
        break()
      endif()
    endforeach()
    if(NOT _pg_header)
      set(PIPETRAIN_NCCL_WHY "the headers of LibTorch ${Torch_VERSION} at ${Torch_DIR} have no c10d ProcessGroupNCCL.hpp")
    else()
      if(NOT PIPETRAIN_NCCL_INCLUDE_DIR)
        # pip: Torch_DIR is site-packages/torch/share/cmake/Torch; nccl.h in site-packages/nvidia/nccl/include.
        get_filename_component(_site "${Torch_DIR}/../../../.." ABSOLUTE)
        find_path(_pipetrain_nccl_h nccl.h HINTS ${TORCH_INCLUDE_DIRS} "${_site}/nvidia/nccl/include")
        if(_pipetrain_nccl_h)
          set(PIPETRAIN_NCCL_INCLUDE_DIR "${_pipetrain_nccl_h}")
        endif()
      endif()
      if(NOT PIPETRAIN_NCCL_INCLUDE_DIR OR NOT EXISTS "${PIPETRAIN_NCCL_INCLUDE_DIR}/nccl.h")
        set(PIPETRAIN_NCCL_WHY "nccl.h was not found (Debian: libnccl-dev, pip: nvidia-nccl-cu12, or set PIPETRAIN_NCCL_INCLUDE_DIR)")
      else()
        set(PIPETRAIN_WITH_NCCL ON)
      endif()
    endif()
  endif()
endif()

if(PIPETRAIN_WITH_NCCL)
  message(STATUS "pipetrain: nccl transport: ON (LibTorch ${Torch_VERSION}, nccl.h in ${PIPETRAIN_NCCL_INCLUDE_DIR})")
elseif(PIPETRAIN_NCCL STREQUAL "ON")
  message(FATAL_ERROR "pipetrain: PIPETRAIN_NCCL=ON, but ${PIPETRAIN_NCCL_WHY}. Use PIPETRAIN_NCCL=AUTO or OFF "
                      "(the gloo, shm, mpi and local transports do not need NCCL).")
else()
  message(STATUS "pipetrain: nccl transport: OFF (${PIPETRAIN_NCCL_WHY})")
endif()
