"""One process of the two-process pipeline run launched by test_pipeline_multihost.py.

Usage: python pipeline_multihost_worker.py COORDINATOR_PORT PROCESS_ID NUM_PROCESSES

Each process owns two CPU devices (set XLA_FLAGS before starting it); the four
devices form one global mesh (stage=2, data=2), so the stage ring and the data
axis both cross the process boundary. Every process runs the same program: three
train steps, then checks them against the unpipelined model computed locally
and prints ``OK <loss>`` on success.
"""

import sys

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh

# pallasopt is imported before `jax.distributed.initialize`, as a training
# script's imports are: importing it must not start a JAX backend (then
# initialize would raise that it came too late).
from pipeline_model import layer, make_batch, make_layers, mse, placed, reference_step
from pallasopt.optim.eformer import AdamWConfig, OptimizerFactory, SchedulerConfig
from pallasopt.pipeline.layout import stages_to_layers
from pallasopt.pipeline.schedule import CircularSchedule
from pallasopt.pipeline.sharding import barrier_sync
from pallasopt.pipeline.train import make_train_step

jax.config.update("jax_cpu_collectives_implementation", "gloo")
port, process_id, num_processes = (int(arg) for arg in sys.argv[1:4])
jax.distributed.initialize(
    coordinator_address=f"127.0.0.1:{port}",
    num_processes=num_processes,
    process_id=process_id,
    initialization_timeout=60,
)

assert jax.process_count() == num_processes and jax.device_count() == 2 * num_processes
schedule = CircularSchedule(2, 4, 2, streamed_io=True)
# Stage-major device order: each stage's two data shards live in one process,
# and the ring between the stages crosses processes.
mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("stage", "data"))
scheduler = SchedulerConfig(learning_rate=1e-2)
make = lambda stacked_axes: OptimizerFactory.create(
    "adamw", scheduler, AdamWConfig(), clip_grad=0.05, stacked_axes=stacked_axes, impl="xla"
)[0]
step = make_train_step(layer, mse, make(schedule.stacked_axes), mesh=mesh, schedule=schedule,
                       data_axis="data")
layers = make_layers(schedule.num_layers)
inputs, targets = make_batch(schedule.num_microbatches)
params, opt_state, batch = placed(step, layers, inputs, targets)

ref_tx = make(1)
ref_step = reference_step(ref_tx, inputs, targets)
ref_params, ref_state = layers, ref_tx.init(layers)
for i in range(3):
  params, opt_state, metrics = step(params, opt_state, *batch)
  ref_params, ref_state, loss, _ = ref_step(ref_params, ref_state)
  np.testing.assert_allclose(float(metrics["loss"]), float(loss), rtol=1e-5)
got = stages_to_layers(multihost_utils.process_allgather(params, tiled=True), schedule)
for key in ref_params:
  np.testing.assert_allclose(got[key], ref_params[key], rtol=0,
                             atol=1e-5 * float(np.max(np.abs(ref_params[key]))))
barrier_sync("pipeline_multihost_done", timeout=60)
print("OK", float(metrics["loss"]), flush=True)
