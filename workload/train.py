"""Training state, the train step, and the loop.

The step is pure and built once (`build`): features (kernels, remat, fp8) are chosen in the
model config, not by branches inside the step. The loop never blocks dispatch on metrics: after
dispatching step n it reads step n-1's loss, so step time = time between completions.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from tpu_operator.models import TrainerConfig, TrainingSpec

from . import data as data_lib
from . import flops as flops_lib
from . import metrics as metrics_lib
from . import model as model_lib
from . import sharding, tuning
from .checkpoint import Checkpointer, abstract_like

log = logging.getLogger(__name__)


def model_config(cfg: TrainerConfig, interpret: bool) -> model_lib.ModelConfig:
    kernels = cfg.kernels
    if kernels.attention == "splash" and kernels.tuning_cache:
        splash = tuning.resolve_splash(kernels.splash, cfg.training.sequence_length, cfg.model.heads,
                                       cfg.model.head_dim, kernels.tuning_cache)
        kernels = kernels.model_copy(update={"splash": splash})
    return model_lib.ModelConfig(dims=cfg.model, kernels=kernels, precision=cfg.training.precision,
                                 remat=cfg.training.remat, interpret=interpret)


def learning_rate(t: TrainingSpec) -> optax.Schedule:
    lr = t.learning_rate
    warmup = min(lr.warmup_steps, t.steps)
    decay_steps = max(t.steps - warmup, 1)
    if lr.schedule == "constant":
        decay = optax.constant_schedule(lr.peak)
    elif lr.schedule == "cosine":
        decay = optax.cosine_decay_schedule(lr.peak, decay_steps, alpha=lr.min_ratio)
    else:
        decay = optax.linear_schedule(lr.peak, lr.peak * lr.min_ratio, decay_steps)
    if warmup == 0:
        return decay
    return optax.join_schedules([optax.linear_schedule(0.0, lr.peak, warmup), decay], [warmup])


def optimizer(t: TrainingSpec) -> optax.GradientTransformation:
    """AdamW with warm-up + schedule and global-norm clipping; no decay on norm scales."""
    decay_mask = lambda params: jax.tree_util.tree_map_with_path(  # noqa: E731
        lambda path, _: "norm" not in jax.tree_util.keystr(path), params)
    adamw = optax.adamw(learning_rate(t), b1=0.9, b2=0.95, weight_decay=t.weight_decay, mask=decay_mask)
    return optax.chain(optax.clip_by_global_norm(t.grad_clip), adamw) if t.grad_clip > 0 else adamw


@dataclasses.dataclass
class Trainer:
    """Everything built once per run: shardings, the jitted init and step."""

    cfg: TrainerConfig
    sharder: sharding.Sharder
    param_shardings: dict
    state_shardings: dict
    abstract_state: dict
    batch_sharding: NamedSharding
    init: callable
    step: callable


def _state_shardings(abstract_state, param_shardings, replicated):
    """Optimizer moments mirror their parameter's sharding (matched by path suffix)."""
    by_path = {jax.tree_util.keystr(p): s for p, s in
               jax.tree_util.tree_flatten_with_path(param_shardings)[0]}

    def pick(path, _):
        for i in range(len(path)):
            s = by_path.get(jax.tree_util.keystr(path[i:]))
            if s is not None:
                return s
        return replicated

    opt = jax.tree_util.tree_map_with_path(pick, abstract_state["opt"])
    return {"params": param_shardings, "opt": opt, "step": replicated}


def build(cfg: TrainerConfig, mesh: jax.sharding.Mesh, interpret: bool | None = None) -> Trainer:
    if interpret is None:
        interpret = jax.default_backend() != "tpu"
    sharder = sharding.Sharder(mesh)
    mcfg = model_config(cfg, interpret)
    tx = optimizer(cfg.training)
    graphdef, abstract_params = nnx.split(nnx.eval_shape(lambda: model_lib.Decoder(mcfg, nnx.Rngs(0))))
    logical = nnx.get_partition_spec(abstract_params).to_pure_dict()
    abstract_params = abstract_params.to_pure_dict()
    param_shardings = jax.tree.map(lambda spec, a: sharder.named(tuple(spec), a.shape), logical, abstract_params,
                                   is_leaf=lambda x: isinstance(x, P))

    def init_state():
        params = nnx.state(model_lib.Decoder(mcfg, nnx.Rngs(cfg.training.seed))).to_pure_dict()
        return {"params": params, "opt": tx.init(params), "step": jnp.zeros((), jnp.int32)}

    abstract_state = jax.eval_shape(init_state)
    replicated = NamedSharding(mesh, P())
    state_shardings = _state_shardings(abstract_state, param_shardings, replicated)
    batch_sharding = sharder.named(("batch", "length"), (cfg.training.global_batch, cfg.training.sequence_length))

    def train_step(state, batch):
        tokens_BT, targets_BT, pos_BT = batch
        with sharding.use(sharder):
            def loss_of(params):
                return model_lib.loss_fn(nnx.merge(graphdef, params), tokens_BT, targets_BT, pos_BT)

            (loss, parts), grads = jax.value_and_grad(loss_of, has_aux=True)(state["params"])
            updates, opt = tx.update(grads, state["opt"], state["params"])
            params = optax.apply_updates(state["params"], updates)
        metrics = {"loss": loss, **parts, "grad_norm": optax.global_norm(grads)}
        return {"params": params, "opt": opt, "step": state["step"] + 1}, metrics

    return Trainer(
        cfg=cfg, sharder=sharder, param_shardings=param_shardings, state_shardings=state_shardings,
        abstract_state=abstract_like(abstract_state, state_shardings), batch_sharding=batch_sharding,
        init=jax.jit(init_state, out_shardings=state_shardings),
        step=jax.jit(train_step, in_shardings=(state_shardings, (batch_sharding,) * 3),
                     out_shardings=(state_shardings, replicated), donate_argnums=0))


def _tensorboard_dir(cfg: TrainerConfig, run_dir: str | None) -> str | None:
    base = cfg.checkpoint.directory or run_dir
    return f"{base.rstrip('/')}/tensorboard" if base else None


def run(cfg: TrainerConfig, *, metrics_port: int | None = None, peak_flops_per_device: float,
        run_dir: str | None = None, status: metrics_lib.Status | None = None) -> dict:
    """Train `cfg` on all global devices; returns the summary record (on every process)."""
    t = cfg.training
    mesh = sharding.make_mesh(cfg.mesh.shape, cfg.slices)
    main = jax.process_index() == 0
    log.info("mesh %s over %d devices (%d processes)", cfg.mesh, mesh.size, jax.process_count())
    trainer = build(cfg, mesh)
    status = status or metrics_lib.Status(t.steps, jax.process_count())
    server = metrics_lib.serve(status, metrics_port) if main and metrics_port is not None else None
    tb = metrics_lib.TensorBoard(_tensorboard_dir(cfg, run_dir) if main else None)
    ckpt = (Checkpointer(cfg.checkpoint.directory, cfg.checkpoint.interval, cfg.checkpoint.keep, t.steps)
            if cfg.checkpoint.directory else None)
    if ckpt and cfg.checkpoint.resume and ckpt.latest_step() is not None:
        state = ckpt.restore(trainer.abstract_state)
    else:
        state = trainer.init()
    sharding.check_shardings(state["params"], trainer.param_shardings)
    start = int(jax.device_get(state["step"]))
    log.info("starting at step %d of %d", start, t.steps)

    batches = data_lib.Batches(data_lib.make_source(t, cfg.model.vocab), trainer.batch_sharding, cfg.mesh.context)
    flops = flops_lib.flops_per_step(cfg.model, t)
    tokens = t.global_batch * t.sequence_length
    last_ckpt = ckpt.last_complete_step() if ckpt else None
    times: list[float] = []
    record: dict = {"step": start, "loss": None}

    def report(step: int, metrics, t_prev: float) -> float:
        nonlocal last_ckpt, record
        loss = float(jax.device_get(metrics["loss"]))  # blocks until step `step` is done
        now = time.perf_counter()
        dt = now - t_prev
        times.append(dt)
        last_ckpt = ckpt.last_complete_step() if ckpt else None
        record = {"step": step, "loss": loss, "step_time_s": dt, "tokens_per_s": tokens / dt,
                  "mfu": flops_lib.mfu(flops, dt, peak_flops_per_device, mesh.size), "last_checkpoint_step": last_ckpt}
        if step % t.log_every == 0 or step == t.steps:
            status.update(**record)
            tb.scalars(step, record)
            if main:
                metrics_lib.emit(record)
        return now

    t_prev = time.perf_counter()
    pending = None
    for step in range(start, t.steps):
        batch = batches(step)
        state, metrics = trainer.step(state, batch)
        # Read step n-1 before saving step n: a save waits for n's arrays, and doing it first would
        # book n's compute as n-1's time (and ~0 for n).
        if pending is not None:
            t_prev = report(*pending, t_prev)
        if ckpt:
            ckpt.maybe_save(step + 1, state)
        pending = (step + 1, metrics)
    if pending is not None:
        report(*pending, t_prev)
    if ckpt:
        last_ckpt = ckpt.finish()
        ckpt.close()
    timed = times[1:] or times
    median = statistics.median(timed) if timed else None
    summary = {"summary": True, "step": t.steps, "loss": record["loss"], "step_time_s": median,
               "tokens_per_s": tokens / median if median else None,
               "mfu": flops_lib.mfu(flops, median, peak_flops_per_device, mesh.size) if median else None,
               "last_checkpoint_step": last_ckpt, "steps_timed": len(timed)}
    status.update(**{k: summary[k] for k in metrics_lib.STEP_KEYS}, state="completed")
    tb.close()
    if main:
        metrics_lib.emit(summary)
    summary["_server"] = server
    return summary
