// scalelab_rules.h — the scale-update rules of every strategy, one header each under rules/, as
// __host__ __device__ scalar functions and functors: the one source of truth for the arithmetic
// of the CUDA update kernels (cuda/kernels/update_kernels.cu: one thread, one thread per layer
// group, or one block) and of the CPU twin (cuda/cpu/update_cpu.cpp). No torch; plain g++
// compiles every header alone (SCALELAB_HD expands to `inline`).
//
// Each rule has a functor form, `<Rule>Update`: the state/statistics pointers and the
// parameters, with `operator()(g)` updating item g (a layer group; 0 for one-thread rules). The
// op implementation (cpu/update_cpu.cpp) builds it once from the tensors, then runs it on the
// CPU (a loop over g) or on the GPU (update_kernels.cu: one thread per g).
//
// Each rule mirrors, operation for operation and in the same floating-point precision, the
// pure-torch update function of its strategy module (its Python twin, the oracle in tests/cuda):
//   rules/native.h            strategies/native.py            native_update_ (torch's when H == 1)
//   rules/max_ema.h           strategies/max_ema.py           max_ema_update_
//   rules/norm_ratio.h        strategies/norm_ratio.py        norm_ratio_update_
//   rules/layerwise.h         strategies/layerwise.py         layerwise_update_
//   rules/adaloss.h           strategies/adaloss.py           adaloss_step_ (layerwise, rule adaloss)
//   rules/amax_history.h      strategies/amax_history.py      amax_history_update_
//   rules/hybrid.h            strategies/hybrid.py            hybrid_update_
//   rules/learned.h           strategies/learned.py           learned_update_
//   rules/underflow_target.h  strategies/underflow_target.py  underflow_target_update_
//   rules/tolerance.h         strategies/tolerance.py         tolerance_update_
//   rules/record_step.h       strategies/state.py             record_step_ (every rule's epilogue)
//   rules/count_fraction.h    strategies/stats.py             count_fraction_reference
// and the pieces several rules share: rules/shared.h (overflowed, clamp, minimum, round down to a
// power of two, amax) and rules/probe.h (the fp32 reference probe of norm_ratio and hybrid).
#pragma once

#include "rules/adaloss.h"
#include "rules/amax_history.h"
#include "rules/count_fraction.h"
#include "rules/hybrid.h"
#include "rules/layerwise.h"
#include "rules/learned.h"
#include "rules/max_ema.h"
#include "rules/native.h"
#include "rules/norm_ratio.h"
#include "rules/record_step.h"
#include "rules/tolerance.h"
#include "rules/underflow_target.h"
