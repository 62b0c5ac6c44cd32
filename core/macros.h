// Portability macros shared by host and CUDA code.
//
// Math that must run identically on CPU and GPU is written once as plain
// functions marked FSDPP_HOST_DEVICE; nvcc compiles them for both sides and a
// host compiler sees ordinary inline functions.
#ifndef FSDPP_CORE_MACROS_H_
#define FSDPP_CORE_MACROS_H_

#if defined(__CUDACC__)
#define FSDPP_HOST_DEVICE __host__ __device__
#define FSDPP_INLINE __host__ __device__ __forceinline__
#else
#define FSDPP_HOST_DEVICE
#define FSDPP_INLINE inline
#endif

#endif  // FSDPP_CORE_MACROS_H_
