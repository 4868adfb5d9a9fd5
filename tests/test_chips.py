"""The one chip table (`pallasopt.chips`): what kernels, compile_check, bench and tests read."""

import pytest

from pallasopt import chips, compile_check
from pallasopt.kernels import _target


@pytest.mark.parametrize("kind,name,gbps", [
    ("NVIDIA H100 80GB HBM3", "NVIDIA H100 SXM", 3350),
    ("NVIDIA H100 PCIe", "NVIDIA H100 PCIe", 2000),
    ("NVIDIA H100 NVL", "NVIDIA H100 NVL", 3900),
    ("NVIDIA H200", "NVIDIA H200 SXM", 4800),
    ("NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB SXM", 2039),
    ("NVIDIA A100 80GB PCIe", "NVIDIA A100 80GB PCIe", 1935),
    ("NVIDIA A100-SXM4-40GB", "NVIDIA A100 40GB", 1555),
    ("TPU v4", "TPU v4", 1200),
    ("TPU v5 lite", "TPU v5e", 819),
    ("TPU v5", "TPU v5p", 2765),
    ("TPU v5p", "TPU v5p", 2765),
    ("TPU v6 lite", "TPU v6e", 1638),
])
def test_datasheet_peaks_by_device_kind(kind, name, gbps):
  peaks = chips.datasheet_peaks(kind)
  assert (peaks.name, peaks.gbps) == (name, gbps)


def test_no_datasheet_for_a_cpu():
  assert chips.datasheet_peaks("cpu") is None


@pytest.mark.parametrize("name", [n for n, c in chips.CHIPS.items() if c.platform == "cuda"])
def test_a_gpu_target_reads_as_its_own_compute_capability(name):
  chip = chips.CHIPS[name]
  assert chips.cuda_capability(chip.device_kind) == chip.compute_capability
  assert chip.gpu is not None and chip.topology is None
  config = compile_check.gpu_target_config(name)
  major, minor = chip.compute_capability
  assert f"cuda_compute_capability {{ major: {major} minor: {minor} }}" in config
  assert f'device_description_str: "{chip.device_kind}"' in config


def test_every_tpu_target_has_a_topology_and_every_kind_it_reports():
  assert chips.TPU_CHIPS == ("v4", "v5e", "v5p", "v6e", "tpu7x")
  for name in chips.TPU_CHIPS:
    chip = chips.CHIPS[name]
    assert chip.topology.split(":")[0] == name and chip.device_kind in chip.kinds
  assert chips.is_chip("TPU v5", "v5p") and chips.is_chip("TPU v5p", "v5p")
  assert not chips.is_chip("TPU v5 lite", "v5p") and not chips.is_chip(None, "v5p")


def test_compile_targets_and_baselines_come_from_the_table():
  assert compile_check.TARGETS == {
      name: (chip.platform, chip.topology) for name, chip in chips.CHIPS.items()
  }
  assert _target.BASELINE_DEVICE_KIND == {
      "tpu": "TPU v4", "cuda": "NVIDIA A100-SXM4-80GB",
  }


def test_more_specific_gpu_names_match_first():
  assert chips.cuda_capability("NVIDIA A100-SXM4-80GB") == (8, 0)
  assert chips.cuda_capability("NVIDIA A10") == (8, 6)
  assert chips.cuda_capability("NVIDIA GH200 480GB") == (9, 0)
  assert chips.cuda_capability("cpu") is None
