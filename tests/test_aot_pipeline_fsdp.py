"""The compile tier, pipeline FSDP: a pipelined train step compiled for a TPU v5e 2x4.

`bench.pipeline_fsdp`'s step (4 stages x 2 devices, 8 repeats of a 1024-wide
MLP block, f32 params and AdamW state): with the 2 devices of each stage as an
FSDP axis, peak memory per device is at most 0.6x that of the same pipeline
with them as a data axis, and the stage-local update runs the Pallas kernels
on each device's slices.
"""

import re

import pytest

import aot_targets
from bench import pipeline_fsdp

pytestmark = pytest.mark.aot


@pytest.mark.long_compile(minutes=2)
def test_fsdp_pipeline_on_a_v5e_2x4_halves_what_a_device_holds():
  aot_targets.require("v5e")
  devices = aot_targets.devices("v5e", "2x4")
  data = pipeline_fsdp.measure(devices, fsdp=False)
  fsdp = pipeline_fsdp.measure(devices, fsdp=True)
  assert fsdp["peak_bytes"] <= 0.6 * data["peak_bytes"], (fsdp, data)


@pytest.mark.long_compile(minutes=1)
@pytest.mark.parametrize("impl,state_format", [("pallas", None), ("auto", "int8")])
def test_fsdp_pipeline_runs_the_kernels_on_each_devices_slices(impl, state_format):
  aot_targets.require("v5e")
  compiled = pipeline_fsdp.compile_step(aot_targets.devices("v5e", "2x4"), fsdp=True,
                                        impl=impl, state_format=state_format)
  assert sum(aot_targets.compiled_kernels(compiled).values()) >= 1
  text = compiled.as_text()
  # The kernels take this device's slices: a stage's 8 repeats of half of
  # each matrix (the norm scales whole), never a whole matrix; int8 codes
  # likewise (their rows of whole 256-blocks split, with their scales).
  width, repeats = pipeline_fsdp.WIDTH, pipeline_fsdp.REPEATS
  kernels = [line.split(" custom-call(")[0] for line in text.splitlines()
             if 'custom_call_target="tpu_custom_call"' in line]
  squeezed = lambda dims: tuple(int(n) for n in dims.split(",") if n != "1")
  operands = {squeezed(dims) for line in kernels
              for dims in re.findall(r"(?:f32|u8)\[([\d,]+)\]", line)}
  halves = {(repeats, width // 2, 4 * width), (repeats, 2 * width, width)}
  scales = {(repeats, 4 * width // 256, width // 2), (repeats, width // 256, 2 * width)}
  assert operands & halves and operands <= halves | scales | {(repeats, width)}, operands
