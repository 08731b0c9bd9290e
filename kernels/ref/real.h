// real.h: the scalar type of the CPU reference.
//
// Every file in kernels/ref/ and model/ is written once over `real`. The library the
// programs link is built with real = float; the tests link a second build of the same sources
// with -DMTRL_REAL_F64 (real = double) for gradient checks against finite differences and the
// fp64 oracle that the CUDA kernels are compared with. A translation unit sees exactly one of
// the two, so a program never links both builds.
#ifndef MTRL_REAL_H
#define MTRL_REAL_H

#ifdef MTRL_REAL_F64
typedef double real;
#define REAL_IS_F64 1
#define REAL_NAME "f64"
#else
typedef float real;
#define REAL_IS_F64 0
#define REAL_NAME "f32"
#endif

#endif
