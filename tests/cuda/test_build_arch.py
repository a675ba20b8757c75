"""What the extension builds for, and where its CUDA ops run, on machines it cannot fully serve:
pre-Volta or unsupported entries of TORCH_CUDA_ARCH_LIST are left out with one warning naming
each (the rest is built), a GPU before Volta turns the CUDA ops off and an old driver the
statistics kernel, each with one warning (the plain-torch twins run instead). No GPU needed:
the device queries are replaced."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from strategies import kernel_build, kernels

NVCC13 = ("13.0", {"75", "80", "86", "89", "90", "100", "120"})


def test_pre_volta_and_unsupported_entries_are_left_out_with_their_reason():
    arch, dropped = kernel_build.build_arch_list("6.0;7.0 7.5;8.0+PTX Pascal;Ampere;9.0", NVCC13)
    assert arch == "7.5;8.0+PTX;Ampere;9.0"
    assert dropped == ["6.0 (before Volta: the statistics kernel's 32 KB parameter needs sm_70 or newer)",
                       "7.0 (nvcc 13.0 cannot compile for it)",
                       "Pascal (before Volta: the statistics kernel's 32 KB parameter needs sm_70 or newer)"]


def test_unknown_nvcc_keeps_every_volta_or_newer_entry():
    assert kernel_build.build_arch_list("5.2;7.0;9.0", None)[0] == "7.0;9.0"


def test_no_buildable_entry_is_one_clear_error():
    with pytest.raises(RuntimeError, match=r"^TORCH_CUDA_ARCH_LIST='6.1' has no architecture the CUDA kernels can "
                                           r"be built for: 6.1 \(before Volta"):
        kernel_build.build_arch_list("6.1", NVCC13)


def test_build_uses_the_filtered_list_warns_once_and_restores_the_variable(monkeypatch):
    from torch.utils import cpp_extension

    seen = []
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "6.1;8.0;9.0")
    monkeypatch.setenv("SCALELAB_EXT_DIR", "/tmp/scalelab-test-build-arch")
    monkeypatch.setattr(kernel_build, "nvcc_archs", lambda: NVCC13)
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: seen.append((os.environ["TORCH_CUDA_ARCH_LIST"],
                                                                           kw["with_cuda"])))
    with pytest.warns(RuntimeWarning, match=r"entries left out of the kernel build: 6\.1 \(before Volta.*"
                                            r"building for 8\.0;9\.0") as rec:
        kernel_build.build(True)
    assert len(rec) == 1 and seen == [("8.0;9.0", True)]
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == "6.1;8.0;9.0"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kernel_build.build(False)  # a CPU build ignores the list
    assert seen[-1] == ("6.1;8.0;9.0", False)


@pytest.fixture
def fake_gpus(monkeypatch):
    """Two GPUs with the given capabilities, nothing cached."""
    caps = {0: (8, 0), 1: (6, 1)}
    monkeypatch.setattr(kernels, "_CUDA_OFF", {})
    monkeypatch.setattr(kernels, "_capability", lambda i: caps[i])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: f"GPU{i}")
    return caps


def test_a_pre_volta_gpu_turns_the_cuda_ops_off_there_with_one_warning(fake_gpus):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kernels._cuda_on(0) and kernels._cuda_on(0, "stats")
    with pytest.warns(RuntimeWarning, match=r"CUDA kernels off: cuda:1 \(GPU1\) is sm_61, the kernels need Volta") \
            as rec:
        assert not kernels._cuda_on(1)
        assert not kernels._cuda_on(1) and not kernels._cuda_on(1, "stats")
    assert len(rec) == 1


def test_an_old_driver_turns_only_the_statistics_kernel_off_with_one_warning(fake_gpus):
    msg = ("scalelab: the statistics kernel needs a CUDA 12.1+ driver and a Volta (sm_70) or newer GPU; "
           "cuda:0 has a CUDA 12.0 driver and sm_80")
    assert msg.startswith(kernels._OLD_DRIVER)
    with pytest.warns(RuntimeWarning, match=r"CUDA 12\.0 driver and sm_80; using the plain-torch statistics") as rec:
        kernels._stats_off(0, msg)
        kernels._stats_off(0, msg)
    assert len(rec) == 1
    assert not kernels._cuda_on(0, "stats") and kernels._cuda_on(0)


def test_load_builds_the_cpu_ops_alone_when_every_gpu_is_pre_volta(monkeypatch, fake_gpus):
    built = []
    fake_gpus[0] = (6, 0)
    monkeypatch.setattr(kernels, "_loaded", None)
    monkeypatch.setattr(kernel_build, "use_cuda", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(kernel_build, "build", built.append)
    monkeypatch.setattr(kernels, "_register_fakes", lambda: None)
    monkeypatch.setattr(torch.ops.scalelab, "unscale_and_stats", object(), raising=False)
    with pytest.warns(RuntimeWarning, match=r"no CUDA kernels: cuda:0 \(GPU0\) is sm_60.*building the CPU ops only"):
        assert kernels.load()
    assert built == [False]
