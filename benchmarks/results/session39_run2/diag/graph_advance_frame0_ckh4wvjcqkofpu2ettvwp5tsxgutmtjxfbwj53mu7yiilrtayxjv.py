# AOT ID: ['0_backward']
from ctypes import c_void_p, c_long, c_int
import torch
import math
import random
import os
import tempfile
from math import inf, nan
from cmath import nanj
from torch._inductor.hooks import run_intermediate_hooks
from torch._inductor.utils import maybe_profile
from torch._inductor.codegen.memory_planning import _align as align
from torch import device, empty_strided
from torch._inductor.async_compile import AsyncCompile
from torch._inductor.select_algorithm import extern_kernels
import triton
import triton.language as tl
from torch._inductor.runtime.triton_heuristics import start_graph, end_graph
from torch._C import _cuda_getCurrentRawStream as get_raw_stream

aten = torch.ops.aten
inductor_ops = torch.ops.inductor
_quantized = torch.ops._quantized
assert_size_stride = torch._C._dynamo.guards.assert_size_stride
assert_alignment = torch._C._dynamo.guards.assert_alignment
empty_strided_cpu = torch._C._dynamo.guards._empty_strided_cpu
empty_strided_cpu_pinned = torch._C._dynamo.guards._empty_strided_cpu_pinned
empty_strided_cuda = torch._C._dynamo.guards._empty_strided_cuda
empty_strided_xpu = torch._C._dynamo.guards._empty_strided_xpu
empty_strided_mtia = torch._C._dynamo.guards._empty_strided_mtia
reinterpret_tensor = torch._C._dynamo.guards._reinterpret_tensor
alloc_from_pool = torch.ops.inductor._alloc_from_pool
async_compile = AsyncCompile()
empty_strided_p2p = torch._C._distributed_c10d._SymmetricMemory.empty_strided_p2p


cpp_fused_add_copy__0 = async_compile.cpp_pybinding(['const int64_t*', 'int64_t*'], r'''
#include <torch/csrc/inductor/cpp_prefix.h>
extern "C"  void  kernel(const int64_t* in_ptr0,
                       int64_t* out_ptr1)
{
    {
        {
            {
                auto tmp0 = in_ptr0[static_cast<int64_t>(0L)];
                auto tmp1 = static_cast<int64_t>(192);
                auto tmp2 = int64_t(tmp0 + tmp1);
                out_ptr1[static_cast<int64_t>(0L)] = tmp2;
            }
        }
    }
}
''')


cpp_fused_add_copy__2 = async_compile.cpp_pybinding(['const int64_t*', 'int64_t*'], r'''
#include <torch/csrc/inductor/cpp_prefix.h>
extern "C"  void  kernel(const int64_t* in_ptr0,
                       int64_t* out_ptr1)
{
    {
        {
            {
                auto tmp0 = in_ptr0[static_cast<int64_t>(0L)];
                auto tmp1 = static_cast<int64_t>(288);
                auto tmp2 = int64_t(tmp0 + tmp1);
                out_ptr1[static_cast<int64_t>(0L)] = tmp2;
            }
        }
    }
}
''')


cpp_fused_add_copy__4 = async_compile.cpp_pybinding(['const int64_t*', 'int64_t*'], r'''
#include <torch/csrc/inductor/cpp_prefix.h>
extern "C"  void  kernel(const int64_t* in_ptr0,
                       int64_t* out_ptr1)
{
    {
        {
            {
                auto tmp0 = in_ptr0[static_cast<int64_t>(0L)];
                auto tmp1 = static_cast<int64_t>(384);
                auto tmp2 = int64_t(tmp0 + tmp1);
                out_ptr1[static_cast<int64_t>(0L)] = tmp2;
            }
        }
    }
}
''')
from torch._C import _cuda_getCurrentRawStream as get_raw_stream



# kernel path: /tmp/torchinductor_root/q6/cq6pqxpd2vnqndtlq56ihbjwmmc5mh6tk4mmd72hf5gr4yid44d7.py
# Topologically Sorted Source Nodes: [full_default, where], Original ATen: [aten.threshold_backward]
# Source node to ATen node mapping:
#   full_default => full_default
#   where => where
# Graph fragment:
#   %le : Tensor "b8[48, 96][96, 1]cuda:0" = PlaceHolder[target=le]
#   %nvfp4_emulated_gemm_3 : Tensor "bf16[48, 96][96, 1]cuda:0" = PlaceHolder[target=nvfp4_emulated_gemm_3]
#   %full_default : Tensor "bf16[][]cuda:0"[num_users=2] = call_function[target=torch.ops.aten.full.default](args = ([], 0.0), kwargs = {dtype: torch.bfloat16, layout: torch.strided, device: cuda:0, pin_memory: False})
#   %where : Tensor "bf16[48, 96][96, 1]cuda:0"[num_users=2] = call_function[target=torch.ops.aten.where.self](args = (%le, %full_default, %nvfp4_emulated_gemm_3), kwargs = {})
#   return %where
triton_poi_fused_threshold_backward_1 = async_compile.triton('triton_poi_fused_threshold_backward_1', '''
import triton
import triton.language as tl

from torch._inductor.runtime import triton_helpers, triton_heuristics
from torch._inductor.runtime.triton_helpers import libdevice, math as tl_math
from torch._inductor.runtime.hints import AutotuneHint, ReductionHint, TileHint, DeviceProperties
triton_helpers.set_driver_to_gpu()

@triton_heuristics.pointwise(
    size_hints={'x': 8192}, 
    filename=__file__,
    triton_meta={'signature': {'in_out_ptr0': '*bf16', 'in_ptr0': '*i1', 'xnumel': 'i32', 'XBLOCK': 'constexpr'}, 'device': DeviceProperties(type='cuda', index=0, multi_processor_count=132, cc=90, major=9, regs_per_multiprocessor=65536, max_threads_per_multi_processor=2048, max_threads_per_block=1024, warp_size=32), 'constants': {}, 'native_matmul': False, 'enable_fp_fusion': True, 'launch_pdl': False, 'disable_ftz': False, 'configs': [{(1,): [['tt.divisibility', 16]], (2,): [['tt.divisibility', 16]]}]},
    inductor_meta={'grid_type': 'Grid1D', 'autotune_hints': set(), 'kernel_name': 'triton_poi_fused_threshold_backward_1', 'mutated_arg_names': ['in_out_ptr0'], 'optimize_mem': True, 'no_x_dim': False, 'atomic_add_found': False, 'num_load': 2, 'num_store': 1, 'num_reduction': 0, 'backend_hash': '91D1D1166449D9E2EB66EB9770C9E2C3B0FEB787341F27FEB4D3F0338DA50336', 'assert_indirect_indexing': True, 'autotune_local_cache': True, 'autotune_pointwise': True, 'autotune_remote_cache': None, 'force_disable_caches': False, 'dynamic_scale_rblock': True, 'max_autotune': False, 'max_autotune_pointwise': False, 'min_split_scan_rblock': 256, 'spill_threshold': 16, 'store_cubin': False, 'deterministic': False, 'force_filter_reduction_configs': False, 'mix_order_reduction_allow_multi_stages': False, 'are_deterministic_algorithms_enabled': False, 'tiling_scores': {'x': 32256}},
    min_elem_per_thread=0
)
@triton.jit
def triton_poi_fused_threshold_backward_1(in_out_ptr0, in_ptr0, xnumel, XBLOCK : tl.constexpr):
    xnumel = 4608
    xoffset = tl.program_id(0) * XBLOCK
    xindex = xoffset + tl.arange(0, XBLOCK)[:]
    xmask = xindex < xnumel
    x0 = xindex
    tmp0 = tl.load(in_ptr0 + (x0), xmask).to(tl.int1)
    tmp1 = tl.load(in_out_ptr0 + (x0), xmask).to(tl.float32)
    tmp2 = tl.full([1], 0.0, tl.float32)
    tmp3 = tl.where(tmp0, tmp2, tmp1)
    tl.store(in_out_ptr0 + (x0), tmp3, xmask)
''', device_str='cuda')

def partition_0(args):
    tangents_1, buf1, buf2, buf3, getitem_33, getitem_34, getitem_35, le, buf4, buf5, buf6, getitem_27, getitem_28, getitem_29 = args
    args.clear()
    assert_size_stride(tangents_1, (48, 64), (64, 1))
    assert_size_stride(getitem_33, (96, 32), (32, 1))
    assert_size_stride(getitem_34, (96, 4), (4, 1))
    assert_size_stride(getitem_35, (), ())
    assert_size_stride(le, (48, 96), (96, 1))
    assert_size_stride(getitem_27, (96, 24), (24, 1))
    assert_size_stride(getitem_28, (96, 3), (3, 1))
    assert_size_stride(getitem_29, (), ())
    with torch.cuda._DeviceGuard(0):
        torch.cuda.set_device(0)
        # Topologically Sorted Source Nodes: [db], Original ATen: [fp_recipes.bias_grad]
        buf7 = torch.ops.fp_recipes.bias_grad.default(tangents_1, torch.bfloat16)
        del tangents_1
        buf8 = buf7
        assert_size_stride(buf8, (64, ), (1, ), 'torch.ops.fp_recipes.bias_grad.default')
        assert_alignment(buf8, 16, 'torch.ops.fp_recipes.bias_grad.default')
        del buf7
        # Topologically Sorted Source Nodes: [dx], Original ATen: [fp_recipes.nvfp4_emulated_gemm]
        buf9 = torch.ops.fp_recipes.nvfp4_emulated_gemm.default(buf1, buf2, buf3, False, 448, getitem_33, getitem_34, getitem_35, False, 448, torch.bfloat16, None)
        del buf1
        del buf2
        del buf3
        del getitem_33
        del getitem_34
        del getitem_35
        buf10 = buf9
        assert_size_stride(buf10, (48, 96), (96, 1), 'torch.ops.fp_recipes.nvfp4_emulated_gemm.default')
        # buffer buf10 (op: torch.ops.fp_recipes.nvfp4_emulated_gemm.default) is assumed to be not aligned
        del buf9
        buf13 = buf10; del buf10  # reuse
        # Topologically Sorted Source Nodes: [full_default, where], Original ATen: [aten.threshold_backward]
        stream0 = get_raw_stream(0)
        triton_poi_fused_threshold_backward_1.run(buf13, le, 4608, stream=stream0)
        del le
        # Topologically Sorted Source Nodes: [db], Original ATen: [fp_recipes.bias_grad]
        buf21 = torch.ops.fp_recipes.bias_grad.default(buf13, torch.bfloat16)
        buf22 = buf21
        assert_size_stride(buf22, (96, ), (1, ), 'torch.ops.fp_recipes.bias_grad.default')
        assert_alignment(buf22, 16, 'torch.ops.fp_recipes.bias_grad.default')
        del buf21
        # Topologically Sorted Source Nodes: [dw], Original ATen: [fp_recipes.nvfp4_emulated_gemm]
        buf11 = torch.ops.fp_recipes.nvfp4_emulated_gemm.default(buf4, buf5, buf6, False, 448, getitem_27, getitem_28, getitem_29, False, 448, torch.bfloat16, None)
        del buf4
        del buf5
        del buf6
        del getitem_27
        del getitem_28
        del getitem_29
        buf12 = buf11
        assert_size_stride(buf12, (64, 96), (96, 1), 'torch.ops.fp_recipes.nvfp4_emulated_gemm.default')
        # buffer buf12 (op: torch.ops.fp_recipes.nvfp4_emulated_gemm.default) is assumed to be not aligned
        del buf11
    return (buf8, buf13, buf22, buf12, )
from torch._C import _cuda_getCurrentRawStream as get_raw_stream



# kernel path: /tmp/torchinductor_root/vf/cvfxg7jk7ydrxqlpd32d2zzpnujc7dkr36ikfgo7e47dohurekwl.py
# Topologically Sorted Source Nodes: [full_default, where_1], Original ATen: [aten.threshold_backward]
# Source node to ATen node mapping:
#   full_default => full_default
#   where_1 => where_1
# Graph fragment:
#   %le_1 : Tensor "b8[48, 128][128, 1]cuda:0" = PlaceHolder[target=le_1]
#   %nvfp4_emulated_gemm_5 : Tensor "bf16[48, 128][128, 1]cuda:0" = PlaceHolder[target=nvfp4_emulated_gemm_5]
#   %full_default : Tensor "bf16[][]cuda:0"[num_users=2] = call_function[target=torch.ops.aten.full.default](args = ([], 0.0), kwargs = {dtype: torch.bfloat16, layout: torch.strided, device: cuda:0, pin_memory: False})
#   %where_1 : Tensor "bf16[48, 128][128, 1]cuda:0"[num_users=2] = call_function[target=torch.ops.aten.where.self](args = (%le_1, %full_default, %nvfp4_emulated_gemm_5), kwargs = {})
#   return %where_1
triton_poi_fused_threshold_backward_3 = async_compile.triton('triton_poi_fused_threshold_backward_3', '''
import triton
import triton.language as tl

from torch._inductor.runtime import triton_helpers, triton_heuristics
from torch._inductor.runtime.triton_helpers import libdevice, math as tl_math
from torch._inductor.runtime.hints import AutotuneHint, ReductionHint, TileHint, DeviceProperties
triton_helpers.set_driver_to_gpu()

@triton_heuristics.pointwise(
    size_hints={'x': 8192}, 
    filename=__file__,
    triton_meta={'signature': {'in_out_ptr0': '*bf16', 'in_ptr0': '*i1', 'xnumel': 'i32', 'XBLOCK': 'constexpr'}, 'device': DeviceProperties(type='cuda', index=0, multi_processor_count=132, cc=90, major=9, regs_per_multiprocessor=65536, max_threads_per_multi_processor=2048, max_threads_per_block=1024, warp_size=32), 'constants': {}, 'native_matmul': False, 'enable_fp_fusion': True, 'launch_pdl': False, 'disable_ftz': False, 'configs': [{(1,): [['tt.divisibility', 16]], (2,): [['tt.divisibility', 16]]}]},
    inductor_meta={'grid_type': 'Grid1D', 'autotune_hints': set(), 'kernel_name': 'triton_poi_fused_threshold_backward_3', 'mutated_arg_names': ['in_out_ptr0'], 'optimize_mem': True, 'no_x_dim': False, 'atomic_add_found': False, 'num_load': 2, 'num_store': 1, 'num_reduction': 0, 'backend_hash': '91D1D1166449D9E2EB66EB9770C9E2C3B0FEB787341F27FEB4D3F0338DA50336', 'assert_indirect_indexing': True, 'autotune_local_cache': True, 'autotune_pointwise': True, 'autotune_remote_cache': None, 'force_disable_caches': False, 'dynamic_scale_rblock': True, 'max_autotune': False, 'max_autotune_pointwise': False, 'min_split_scan_rblock': 256, 'spill_threshold': 16, 'store_cubin': False, 'deterministic': False, 'force_filter_reduction_configs': False, 'mix_order_reduction_allow_multi_stages': False, 'are_deterministic_algorithms_enabled': False, 'tiling_scores': {'x': 43008}},
    min_elem_per_thread=0
)
@triton.jit
def triton_poi_fused_threshold_backward_3(in_out_ptr0, in_ptr0, xnumel, XBLOCK : tl.constexpr):
    xnumel = 6144
    xoffset = tl.program_id(0) * XBLOCK
    xindex = xoffset + tl.arange(0, XBLOCK)[:]
    xmask = xindex < xnumel
    x0 = xindex
    tmp0 = tl.load(in_ptr0 + (x0), xmask).to(tl.int1)
    tmp1 = tl.load(in_out_ptr0 + (x0), xmask).to(tl.float32)
    tmp2 = tl.full([1], 0.0, tl.float32)
    tmp3 = tl.where(tmp0, tmp2, tmp1)
    tl.store(in_out_ptr0 + (x0), tmp3, xmask)
''', device_str='cuda')

def partition_1(args):
    buf15, buf16, buf17, getitem_21, getitem_22, getitem_23, le_1, buf18, buf19, buf20, getitem_15, getitem_16, getitem_17 = args
    args.clear()
    assert_size_stride(getitem_21, (128, 48), (48, 1))
    assert_size_stride(getitem_22, (128, 6), (6, 1))
    assert_size_stride(getitem_23, (), ())
    assert_size_stride(le_1, (48, 128), (128, 1))
    assert_size_stride(getitem_15, (128, 24), (24, 1))
    assert_size_stride(getitem_16, (128, 3), (3, 1))
    assert_size_stride(getitem_17, (), ())
    with torch.cuda._DeviceGuard(0):
        torch.cuda.set_device(0)
        # Topologically Sorted Source Nodes: [dx], Original ATen: [fp_recipes.nvfp4_emulated_gemm]
        buf23 = torch.ops.fp_recipes.nvfp4_emulated_gemm.default(buf15, buf16, buf17, False, 448, getitem_21, getitem_22, getitem_23, False, 448, torch.bfloat16, None)
        del buf15
        del buf16
        del buf17
        del getitem_21
        del getitem_22
        del getitem_23
        buf24 = buf23
        assert_size_stride(buf24, (48, 128), (128, 1), 'torch.ops.fp_recipes.nvfp4_emulated_gemm.default')
        # buffer buf24 (op: torch.ops.fp_recipes.nvfp4_emulated_gemm.default) is assumed to be not aligned
        del buf23
        buf27 = buf24; del buf24  # reuse
        # Topologically Sorted Source Nodes: [full_default, where_1], Original ATen: [aten.threshold_backward]
        stream0 = get_raw_stream(0)
        triton_poi_fused_threshold_backward_3.run(buf27, le_1, 6144, stream=stream0)
        del le_1
        # Topologically Sorted Source Nodes: [db], Original ATen: [fp_recipes.bias_grad]
        buf35 = torch.ops.fp_recipes.bias_grad.default(buf27, torch.bfloat16)
        buf36 = buf35
        assert_size_stride(buf36, (128, ), (1, ), 'torch.ops.fp_recipes.bias_grad.default')
        assert_alignment(buf36, 16, 'torch.ops.fp_recipes.bias_grad.default')
        del buf35
        # Topologically Sorted Source Nodes: [dw], Original ATen: [fp_recipes.nvfp4_emulated_gemm]
        buf25 = torch.ops.fp_recipes.nvfp4_emulated_gemm.default(buf18, buf19, buf20, False, 448, getitem_15, getitem_16, getitem_17, False, 448, torch.bfloat16, None)
        del buf18
        del buf19
        del buf20
        del getitem_15
        del getitem_16
        del getitem_17
        buf26 = buf25
        assert_size_stride(buf26, (96, 128), (128, 1), 'torch.ops.fp_recipes.nvfp4_emulated_gemm.default')
        # buffer buf26 (op: torch.ops.fp_recipes.nvfp4_emulated_gemm.default) is assumed to be not aligned
        del buf25
    return (buf27, buf36, buf26, )


def partition_2(args):
    buf32, buf33, buf34, getitem_3, getitem_4, getitem_5 = args
    args.clear()
    assert_size_stride(getitem_3, (64, 24), (24, 1))
    assert_size_stride(getitem_4, (64, 3), (3, 1))
    assert_size_stride(getitem_5, (), ())
    with torch.cuda._DeviceGuard(0):
        torch.cuda.set_device(0)
        # Topologically Sorted Source Nodes: [dw], Original ATen: [fp_recipes.nvfp4_emulated_gemm]
        buf37 = torch.ops.fp_recipes.nvfp4_emulated_gemm.default(buf32, buf33, buf34, False, 448, getitem_3, getitem_4, getitem_5, False, 448, torch.bfloat16, None)
        del buf32
        del buf33
        del buf34
        del getitem_3
        del getitem_4
        del getitem_5
        buf38 = buf37
        assert_size_stride(buf38, (128, 64), (64, 1), 'torch.ops.fp_recipes.nvfp4_emulated_gemm.default')
        # buffer buf38 (op: torch.ops.fp_recipes.nvfp4_emulated_gemm.default) is assumed to be not aligned
        del buf37
    return (buf38, )


async_compile.wait(globals())
del async_compile

class Runner:
    def __init__(self, partitions):
        self.partitions = partitions

    def recursively_apply_fns(self, fns):
        new_callables = []
        for fn, c in zip(fns, self.partitions):
            new_callables.append(fn(c))
        self.partitions = new_callables

    def call(self, args):
        getitem_3, getitem_4, getitem_5, getitem_15, getitem_16, getitem_17, getitem_21, getitem_22, getitem_23, getitem_27, getitem_28, getitem_29, getitem_33, getitem_34, getitem_35, le, le_1, primals_4, primals_5, primals_8, primals_9, primals_12, primals_13, tangents_1 = args
        args.clear()
        with torch.cuda._DeviceGuard(0):
            torch.cuda.set_device(0)
            # Topologically Sorted Source Nodes: [nvfp4_quantize_sr_state_default], Original ATen: [fp_recipes.nvfp4_quantize_sr_state]
            buf0 = torch.ops.fp_recipes.nvfp4_quantize_sr_state.default(tangents_1, None, True, True, False, False, False, 448, False, False, True, primals_13, primals_12, 0)
            del primals_13
            buf1 = buf0[0]
            assert_size_stride(buf1, (48, 32), (32, 1), 'torch.ops.fp_recipes.nvfp4_quantize_sr_state.default')
            # buffer buf1 (op: torch.ops.fp_recipes.nvfp4_quantize_sr_state.default) is assumed to be not aligned
            buf2 = buf0[1]
            assert_size_stride(buf2, (48, 4), (4, 1), 'torch.ops.fp_recipes.nvfp4_quantize_sr_state.default')
            # buffer buf2 (op: torch.ops.fp_recipes.nvfp4_quantize_sr_state.default) is assumed to be not aligned
            buf3 = buf0[2]
            assert_size_stride(buf3, (), (), 'torch.ops.fp_recipes.nvfp4_quantize_sr_state.default')
            # buffer buf3 (op: torch.ops.fp_recipes.nvfp4_quantize_sr_state.default) is assumed to be not aligned
            buf4 = buf0[3]
            assert_size_stride(buf4, (64, 24), (24, 1), 'torch.ops.fp_recipes.nvfp4_quantize_sr_state.default')
            # buffer buf4 (op: torch.ops.fp_recipes.nvfp4_quantize_sr_state.default) is assumed to be not aligned
            buf5 = buf0[4]
            assert_size_stride(buf5, (64, 3), (3, 1), 'torch.ops.fp_recipes.nvfp4_quantize_sr_state.default')
            # buffer buf5 (op: torch.ops.fp_recipes.nvfp4_quantize_sr_state.default) is assumed to be not aligned
            buf6 = buf0[5]
            assert_size_stride(buf6, (), (), 'torch.ops.fp_recipes.nvfp4_quantize_sr_state.default')
            # buffer buf6 (op: torch.ops.fp_recipes.nvfp4_quantize_sr_state.default) is assumed to be not aligned
            del buf0
        cpp_fused_add_copy__0(primals_12, primals_12)
        del primals_12
        partition0_args = [tangents_1, buf1, buf2, buf3, getitem_33, getitem_34, getitem_35, le, buf4, buf5, buf6, getitem_27, getitem_28, getitem_29]
        del tangents_1, buf1, buf2, buf3, getitem_33, getitem_34, getitem_35, le, buf4, buf5, buf6, getitem_27, getitem_28, getitem_29
        (buf8, buf13, buf22, buf12) = self.partitions[0](partition0_args)
        del partition0_args
        with torch.cuda._DeviceGuard(0):
            torch.cuda.set_device(0)
            # Topologically Sorted Source Nodes: [nvfp4_quantize_sr_state_default], Original ATen: [fp_recipes.nvfp4_quantize_sr_state]
            buf14 = torch.ops.fp_recipes.nvfp4_quantize_sr_state.default(buf13, None, True, True, False, False, False, 448, False, False, True, primals_9, primals_8, 0)
            del buf13
            del primals_9
            buf15 = buf14[0]
            assert_size_stride(buf15, (48, 48), (48, 1), 'torch.ops.fp_recipes.nvfp4_quantize_sr_state.default')
            # buffer buf15 (op: torch.ops.fp_recipes.nvfp4_quantize_sr_state.default) is assumed to be not aligned
            buf16 = buf14[1]
            assert_size_stride(buf16, (48, 6), (6, 1), 'torch.ops.fp_recipes.nvfp4_quantize_sr_state.default')
            # buffer buf16 (op: torch.ops.fp_recipes.nvfp4_quantize_sr_state.default) is assumed to be not aligned
            buf17 = buf14[2]
            assert_size_stride(buf17, (), (), 'torch.ops.fp_recipes.nvfp4_quantize_sr_state.default')
            # buffer buf17 (op: torch.ops.fp_recipes.nvfp4_quantize_sr_state.default) is assumed to be not aligned
            buf18 = buf14[3]
            assert_size_stride(buf18, (96, 24), (24, 1), 'torch.ops.fp_recipes.nvfp4_quantize_sr_state.default')
            # buffer buf18 (op: torch.ops.fp_recipes.nvfp4_quantize_sr_state.default) is assumed to be not aligned
            buf19 = buf14[4]
            assert_size_stride(buf19, (96, 3), (3, 1), 'torch.ops.fp_recipes.nvfp4_quantize_sr_state.default')
            # buffer buf19 (op: torch.ops.fp_recipes.nvfp4_quantize_sr_state.default) is assumed to be not aligned
            buf20 = buf14[5]
            assert_size_stride(buf20, (), (), 'torch.ops.fp_recipes.nvfp4_quantize_sr_state.default')
            # buffer buf20 (op: torch.ops.fp_recipes.nvfp4_quantize_sr_state.default) is assumed to be not aligned
            del buf14
        cpp_fused_add_copy__2(primals_8, primals_8)
        del primals_8
        partition1_args = [buf15, buf16, buf17, getitem_21, getitem_22, getitem_23, le_1, buf18, buf19, buf20, getitem_15, getitem_16, getitem_17]
        del buf15, buf16, buf17, getitem_21, getitem_22, getitem_23, le_1, buf18, buf19, buf20, getitem_15, getitem_16, getitem_17
        (buf27, buf36, buf26) = self.partitions[1](partition1_args)
        del partition1_args
        with torch.cuda._DeviceGuard(0):
            torch.cuda.set_device(0)
            # Topologically Sorted Source Nodes: [nvfp4_quantize_sr_state_default], Original ATen: [fp_recipes.nvfp4_quantize_sr_state]
            buf28 = torch.ops.fp_recipes.nvfp4_quantize_sr_state.default(buf27, None, True, True, False, False, False, 448, False, False, True, primals_5, primals_4, 0)
            del buf27
            del primals_5
            buf32 = buf28[3]
            assert_size_stride(buf32, (128, 24), (24, 1), 'torch.ops.fp_recipes.nvfp4_quantize_sr_state.default')
            # buffer buf32 (op: torch.ops.fp_recipes.nvfp4_quantize_sr_state.default) is assumed to be not aligned
            buf33 = buf28[4]
            assert_size_stride(buf33, (128, 3), (3, 1), 'torch.ops.fp_recipes.nvfp4_quantize_sr_state.default')
            # buffer buf33 (op: torch.ops.fp_recipes.nvfp4_quantize_sr_state.default) is assumed to be not aligned
            buf34 = buf28[5]
            assert_size_stride(buf34, (), (), 'torch.ops.fp_recipes.nvfp4_quantize_sr_state.default')
            # buffer buf34 (op: torch.ops.fp_recipes.nvfp4_quantize_sr_state.default) is assumed to be not aligned
            del buf28
        cpp_fused_add_copy__4(primals_4, primals_4)
        del primals_4
        partition2_args = [buf32, buf33, buf34, getitem_3, getitem_4, getitem_5]
        del buf32, buf33, buf34, getitem_3, getitem_4, getitem_5
        (buf38,) = self.partitions[2](partition2_args)
        del partition2_args
        return (None, buf38, buf36, None, None, buf26, buf22, None, None, buf12, buf8, None, None, )

runner = Runner(partitions=[partition_0, partition_1, partition_2])
call = runner.call
recursively_apply_fns = runner.recursively_apply_fns


def get_args():
    from torch._dynamo.testing import rand_strided
    getitem_3 = rand_strided((64, 24), (24, 1), device='cuda:0', dtype=torch.uint8)
    getitem_4 = rand_strided((64, 3), (3, 1), device='cuda:0', dtype=torch.float8_e4m3fn)
    getitem_5 = rand_strided((), (), device='cuda:0', dtype=torch.float32)
    getitem_15 = rand_strided((128, 24), (24, 1), device='cuda:0', dtype=torch.uint8)
    getitem_16 = rand_strided((128, 3), (3, 1), device='cuda:0', dtype=torch.float8_e4m3fn)
    getitem_17 = rand_strided((), (), device='cuda:0', dtype=torch.float32)
    getitem_21 = rand_strided((128, 48), (48, 1), device='cuda:0', dtype=torch.uint8)
    getitem_22 = rand_strided((128, 6), (6, 1), device='cuda:0', dtype=torch.float8_e4m3fn)
    getitem_23 = rand_strided((), (), device='cuda:0', dtype=torch.float32)
    getitem_27 = rand_strided((96, 24), (24, 1), device='cuda:0', dtype=torch.uint8)
    getitem_28 = rand_strided((96, 3), (3, 1), device='cuda:0', dtype=torch.float8_e4m3fn)
    getitem_29 = rand_strided((), (), device='cuda:0', dtype=torch.float32)
    getitem_33 = rand_strided((96, 32), (32, 1), device='cuda:0', dtype=torch.uint8)
    getitem_34 = rand_strided((96, 4), (4, 1), device='cuda:0', dtype=torch.float8_e4m3fn)
    getitem_35 = rand_strided((), (), device='cuda:0', dtype=torch.float32)
    le = rand_strided((48, 96), (96, 1), device='cuda:0', dtype=torch.bool)
    le_1 = rand_strided((48, 128), (128, 1), device='cuda:0', dtype=torch.bool)
    primals_4 = rand_strided((), (), device='cpu', dtype=torch.int64)
    primals_5 = rand_strided((), (), device='cpu', dtype=torch.int64)
    primals_8 = rand_strided((), (), device='cpu', dtype=torch.int64)
    primals_9 = rand_strided((), (), device='cpu', dtype=torch.int64)
    primals_12 = rand_strided((), (), device='cpu', dtype=torch.int64)
    primals_13 = rand_strided((), (), device='cpu', dtype=torch.int64)
    tangents_1 = rand_strided((48, 64), (64, 1), device='cuda:0', dtype=torch.bfloat16)
    return [getitem_3, getitem_4, getitem_5, getitem_15, getitem_16, getitem_17, getitem_21, getitem_22, getitem_23, getitem_27, getitem_28, getitem_29, getitem_33, getitem_34, getitem_35, le, le_1, primals_4, primals_5, primals_8, primals_9, primals_12, primals_13, tangents_1]


def benchmark_compiled_module(args, times=10, repeat=10):
    from torch._inductor.utils import print_performance
    fn = lambda: call(list(args))
    return print_performance(fn, times=times, repeat=repeat)


if __name__ == "__main__":
    from torch._inductor.wrapper_benchmark import compiled_module_main
    args = get_args()
    compiled_module_main('None', lambda times, repeat: benchmark_compiled_module(args, times=times, repeat=repeat))
