from __future__ import annotations

import pytest

from deploy.gpus import detect_gpus, parse_gpu_list, parse_nvidia_smi

SMI = """GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-aaaa)
GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-bbbb)
  MIG 1g.10gb     Device  0: (UUID: MIG-cccc)
"""


def _no_smi() -> str | None:
    return None


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0,1", ["0", "1"]),
        (" 2, 3 ,", ["2", "3"]),
        ("", []),
        ("-1", []),
        ("GPU-aaaa", ["GPU-aaaa"]),
    ],
)
def test_gpu_lists_follow_cuda_visible_devices_conventions(text: str, expected: list[str]) -> None:
    assert parse_gpu_list(text) == expected


def test_nvidia_smi_gpus_are_counted_and_mig_lines_ignored() -> None:
    assert parse_nvidia_smi(SMI) == ["0", "1"]


def test_explicit_gpus_win_over_environment_and_nvidia_smi() -> None:
    assert detect_gpus("3", {"CUDA_VISIBLE_DEVICES": "0,1"}, lambda: SMI) == ["3"]


def test_cuda_visible_devices_entries_are_passed_on_unchanged() -> None:
    assert detect_gpus(None, {"CUDA_VISIBLE_DEVICES": "4,6"}, lambda: SMI) == ["4", "6"]


def test_empty_cuda_visible_devices_hides_all_gpus() -> None:
    assert detect_gpus(None, {"CUDA_VISIBLE_DEVICES": ""}, lambda: SMI) == []


def test_nvidia_smi_is_asked_when_nothing_else_says() -> None:
    assert detect_gpus(None, {}, lambda: SMI) == ["0", "1"]


def test_no_nvidia_smi_means_cpu() -> None:
    assert detect_gpus(None, {}, _no_smi) == []


def test_cuda_visible_devices_without_any_gpu_falls_back_to_the_cpu() -> None:
    notes: list[str] = []
    gpus = detect_gpus(
        None, {"CUDA_VISIBLE_DEVICES": "0"}, _no_smi, driver=lambda: False, note=notes.append
    )
    assert gpus == []
    assert len(notes) == 1 and "CUDA_VISIBLE_DEVICES=0" in notes[0] and "CPU" in notes[0]


def test_cuda_visible_devices_is_kept_where_the_driver_is_present() -> None:
    notes: list[str] = []
    env = {"CUDA_VISIBLE_DEVICES": "1"}
    assert detect_gpus(None, env, _no_smi, driver=lambda: True, note=notes.append) == ["1"]
    assert detect_gpus(None, env, lambda: SMI, driver=lambda: False, note=notes.append) == ["1"]
    assert notes == []
