"""Training state, the train step, and the loop.

The step is pure and built once (`build`): features (kernels, remat, fp8) are chosen in the
model config, not by branches inside the step. A run is set up once (`setup`), then `train` loops
over the steps and calls its hooks (stdout line, /status, TensorBoard, checkpoint); it never
blocks dispatch on metrics: after dispatching step n it reads step n-1's loss, so step time =
time between completions. The metrics server belongs to the caller (`__main__`).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tpu_operator.api.contract import TrainerConfig, TrainingSpec

from ..data import batches as data_lib
from ..data import fingerprint
from ..model import decoder as model_lib
from ..model import loss as loss_lib
from ..model import sharding
from ..performance import flops as flops_lib
from ..performance import tuning
from ..process import exits
from ..process import metrics as metrics_lib
from . import divergence, evaluation
from .checkpoint import Checkpointer, abstract_like
from .hooks import Hook, Run, StepRecord, Summary, Trainer
from .progress import Clock

log = logging.getLogger(__name__)


def loss_tiling(cfg: TrainerConfig) -> tuple[int, int]:
    """(sequence chunks, vocabulary tiles) of the LM head and cross entropy (loss.tiling): one gathered
    tile of the weight under loss.WEIGHT_TILE_BYTES, one chunk's f32 logits tile per device under
    loss.LOGITS_TILE_BYTES."""
    m, t = cfg.mesh, cfg.training
    batch = -(-t.microbatch // (m.data * m.fsdp * m.expert))
    return loss_lib.tiling(batch, t.sequence_length // m.context, cfg.model.model_dim, cfg.model.vocab, m.tensor)


def keeps_logits(cfg: TrainerConfig) -> bool:
    """Whether the head keeps its logits for the backward (loss.logits_kept)."""
    m, t = cfg.mesh, cfg.training
    batch = -(-t.microbatch // (m.data * m.fsdp * m.expert))
    return loss_lib.logits_kept(batch, t.sequence_length // m.context, cfg.model.vocab, m.tensor, *loss_tiling(cfg))


# One slice's [tokens, F / slices] MLP activation per device stays under this (mlp_chunks).
MLP_CHUNK_BYTES = 128 << 20


def mlp_chunks(cfg: TrainerConfig) -> int:
    """Slices of the dense MLP's hidden dimension F (model.MLP): more than one only where the layer is
    recomputed without keeping the MLP's activations (remat full, or custom with mlp_in recomputed),
    each slice's bf16 [tokens, F / slices] activation per device under MLP_CHUNK_BYTES, every slice
    split evenly over `tensor` and at least 128 wide (the MXU's tile)."""
    m, t, remat = cfg.mesh, cfg.training, cfg.training.remat
    recomputed = remat.policy == "full" or (
        remat.policy == "custom" and remat.tensors.get("mlp_in", "remat") == "remat"
    )
    if cfg.model.is_moe or not recomputed:
        return 1
    batch = -(-t.microbatch // (m.data * m.fsdp * m.expert))
    tokens, width = batch * (t.sequence_length // m.context), cfg.model.mlp_dim // m.tensor
    chunks = 1
    while (
        tokens * (width // chunks) * 2 > MLP_CHUNK_BYTES and width % (2 * chunks) == 0 and width // (2 * chunks) >= 128
    ):
        chunks *= 2
    return chunks


def model_config(cfg: TrainerConfig, interpret: bool, device_kind: str | None = None) -> model_lib.ModelConfig:
    """The model as `cfg` describes it; `device_kind` (the mesh's chip) picks tuned kernel tiles."""
    kernels = cfg.kernels
    if kernels.tuning_cache and kernels.attention == "splash":
        splash = tuning.resolve_splash(kernels.splash, tuning.SplashShape.of(cfg), kernels.tuning_cache, device_kind)
        kernels = kernels.model_copy(update={"splash": splash})
    if kernels.tuning_cache and cfg.model.is_moe and kernels.moe_matmul == "gmm":
        gmm = tuning.resolve_gmm(kernels.gmm, tuning.GmmShape.of(cfg), kernels.tuning_cache, device_kind)
        kernels = kernels.model_copy(update={"gmm": gmm})
    chunks, tiles = loss_tiling(cfg)
    return model_lib.ModelConfig(
        dims=cfg.model,
        kernels=kernels,
        precision=cfg.training.precision,
        remat=cfg.training.remat,
        interpret=interpret,
        loss_chunks=chunks,
        vocab_tiles=tiles,
        keep_logits=keeps_logits(cfg),
        mlp_chunks=mlp_chunks(cfg),
    )


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
        lambda path, _: "norm" not in jax.tree_util.keystr(path), params
    )
    adamw = optax.adamw(
        learning_rate(t),
        b1=t.adam.beta1,
        b2=t.adam.beta2,
        eps=t.adam.epsilon,
        weight_decay=t.weight_decay,
        mask=decay_mask,
    )
    return optax.chain(optax.clip_by_global_norm(t.grad_clip), adamw) if t.grad_clip > 0 else adamw


def _state_shardings(abstract_state, param_shardings, replicated):
    """Optimizer moments mirror their parameter's sharding (matched by path suffix)."""
    by_path = {jax.tree_util.keystr(p): s for p, s in jax.tree_util.tree_flatten_with_path(param_shardings)[0]}

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
    mcfg = model_config(cfg, interpret, mesh.devices.flat[0].device_kind)
    tx = optimizer(cfg.training)
    graphdef, abstract_params = nnx.split(nnx.eval_shape(lambda: model_lib.Decoder(mcfg, nnx.Rngs(0))))
    logical = nnx.get_partition_spec(abstract_params).to_pure_dict()
    abstract_params = abstract_params.to_pure_dict()
    param_shardings = jax.tree.map(
        lambda spec, a: sharder.named(tuple(spec), a.shape),
        logical,
        abstract_params,
        is_leaf=lambda x: isinstance(x, P),
    )

    def init_state():
        params = nnx.state(model_lib.Decoder(mcfg, nnx.Rngs(cfg.training.seed))).to_pure_dict()
        return {"params": params, "opt": tx.init(params), "step": jnp.zeros((), jnp.int32)}

    def state_around(params):
        """A new run's state from given parameters (spec.model.init): the optimizer starts fresh."""
        return {"params": params, "opt": tx.init(params), "step": jnp.zeros((), jnp.int32)}

    abstract_state = jax.eval_shape(init_state)
    replicated = NamedSharding(mesh, P())
    state_shardings = _state_shardings(abstract_state, param_shardings, replicated)
    batch_sharding = sharder.named(("batch", "length"), (cfg.training.global_batch, cfg.training.sequence_length))

    micro = cfg.training.microbatches
    micro_sharding = sharder.named(("batch", "length"), (cfg.training.microbatch, cfg.training.sequence_length))
    weights = model_lib.LossWeights(moe_aux=cfg.training.moe_aux_loss_weight, z_loss=cfg.training.z_loss_weight)
    schedule = learning_rate(cfg.training)

    def microbatches_of(batch):
        """[M, B / M, T] arrays of a Batch: microbatch m takes rows m, m + M, ... (the Batch's None fields
        stay None)."""
        return jax.tree.map(lambda a_BT: a_BT.reshape(-1, micro, a_BT.shape[-1]).swapaxes(0, 1), batch)

    def loss_and_grads(params, batch):
        def loss_of(params):
            return model_lib.loss_fn(
                nnx.merge(graphdef, params),
                batch.inputs,
                batch.targets,
                batch.positions,
                batch.segments,
                batch.mask,
                weights=weights,
            )

        return jax.value_and_grad(loss_of, has_aux=True)(params)

    def accumulated(params, batch):
        """The whole batch's loss and gradients, one microbatch at a time: microbatch m's share is its
        part of the tokens the loss counts (1 / M each without a mask). Microbatch m takes rows m, m + M,
        ...: each device's rows split among the microbatches, so no row moves between devices."""
        micro_batches = microbatches_of(batch)
        counts_M = jnp.ones((micro,)) if batch.mask is None else jnp.sum(micro_batches.mask, axis=(1, 2))
        shares_M = counts_M / jnp.maximum(jnp.sum(counts_M), 1.0)
        micro_batch = jax.tree.map(lambda a: a[: cfg.training.microbatch], batch)
        (loss_parts, _) = jax.eval_shape(loss_and_grads, params, micro_batch)
        # The gradient sum is sharded as the parameters are (left free, XLA may replicate it).
        grads = jax.tree.map(
            lambda p, s: jax.lax.with_sharding_constraint(jnp.zeros(p.shape, jnp.float32), s), params, param_shardings
        )
        zeros = (jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), loss_parts), grads)

        def one(acc, xs):
            mb, share = xs
            mb = jax.tree.map(lambda a: jax.lax.with_sharding_constraint(a, micro_sharding), mb)
            return jax.tree.map(lambda a, b: a + share * b, acc, loss_and_grads(params, mb)), None

        total, _ = jax.lax.scan(one, zeros, (micro_batches, shares_M))
        return total

    def eval_step(params, batch):
        """A held-out global batch's summed cross entropy and the tokens it counts (no aux or z-loss), one
        microbatch at a time (the memory of a training microbatch, forward only)."""

        def one(sums, mb):
            mb = jax.tree.map(lambda a: jax.lax.with_sharding_constraint(a, micro_sharding), mb)
            with sharding.use(sharder):
                _, parts = model_lib.loss_fn(
                    nnx.merge(graphdef, params), mb.inputs, mb.targets, mb.positions, mb.segments, mb.mask
                )
            count = jnp.float32(mb.targets.size) if mb.mask is None else jnp.sum(mb.mask)
            return (sums[0] + parts["ce"] * count, sums[1] + count), None

        return jax.lax.scan(one, (jnp.float32(0), jnp.float32(0)), microbatches_of(batch))[0]

    step_grads = loss_and_grads if micro == 1 else accumulated

    def update_with(grads_of):
        def update(state, batch):
            with sharding.use(sharder):
                (loss, parts), grads = grads_of(state["params"], batch)
                updates, opt = tx.update(grads, state["opt"], state["params"])
                params = optax.apply_updates(state["params"], updates)
            metrics = {
                "loss": loss,
                **parts,
                "grad_norm": optax.tree.norm(grads),
                "learning_rate": schedule(state["step"]),
            }
            return {"params": params, "opt": opt, "step": state["step"] + 1}, metrics

        return update

    def checked(update):
        """`update` applied only where its loss and gradient norm are finite, else the state as it was
        (so no non-finite value ever reaches the state in memory), with the flag in the metrics: read
        with them, never waited for on its own (divergence.py). The select fuses into the update's own
        elementwise pass. Named train_step: profiles show `jit_train_step` (test_profiling.py counts it)."""

        def train_step(state, batch):
            new, metrics = update(state, batch)
            finite = jnp.isfinite(metrics["loss"]) & jnp.isfinite(metrics["grad_norm"])
            kept = jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, state)
            return kept, {**metrics, "finite": finite}

        return train_step

    def poisoned(params, batch):
        """A divergence on demand (faults.py): the loss and every gradient NaN, as a real blow-up's are."""
        return jax.tree.map(lambda a: a * jnp.nan, step_grads(params, batch))

    def jitted(step):
        return jax.jit(
            step,
            in_shardings=(state_shardings, batch_sharding),  # every array of the Batch
            out_shardings=(state_shardings, replicated),
            donate_argnums=0,
        )

    return Trainer(
        cfg=cfg,
        sharder=sharder,
        param_shardings=param_shardings,
        state_shardings=state_shardings,
        abstract_state=abstract_like(abstract_state, state_shardings),
        batch_sharding=batch_sharding,
        init=jax.jit(init_state, out_shardings=state_shardings),
        start_from=jax.jit(state_around, in_shardings=(param_shardings,), out_shardings=state_shardings),
        eval_step=jax.jit(eval_step, out_shardings=(replicated, replicated)),
        step=jitted(checked(update_with(step_grads))),
        update=update_with(step_grads),
        poisoned_step=lambda: jitted(checked(update_with(poisoned))),
    )


# ---------------------------------------------------------------------------------------------
# The run: set-up, the loop with its hooks (the types they share are in hooks.py)


def data_fingerprint(t: TrainingSpec) -> dict:
    """What decides the data order of `t` (fingerprint.py), with the files a files source reads."""
    files = tokenizer = None
    if t.data.source == "files":
        files = fingerprint.listed_files(t.data.path, t.data.format)
    if t.data.tokenizer:
        tokenizer = fingerprint.tokenizer_file(t.data.tokenizer)
    return fingerprint.of(t, files, tokenizer)


def check_data_unchanged(saved: dict, now: dict, allow_change: bool, step: int) -> None:
    """Refuse a resume that would read other data than the interrupted run (fingerprint.py)."""
    changed = fingerprint.changes(saved, now)
    if not changed:
        return
    what = "; ".join(f"spec.training.{line}" for line in changed)
    if not allow_change:
        raise exits.UserError(
            f"the checkpoint at step {step} was trained on another data order: {what}. "
            "Resuming would read other data than the interrupted run; restore the settings, "
            "or set spec.training.data.allowChange: true to resume with the new data order"
        )
    log.warning("resuming at step %d with a changed data order (data.allowChange): %s", step, what)


def initial_params(cfg: TrainerConfig, trainer: Trainer) -> dict:
    """spec.model.init's parameters on the run's shardings; a checkpoint of another shape, or one our model
    cannot express, is the user's to fix (exit 3, the reason naming the field or tensor)."""
    from ..interchange import hf_config, pretrained, tensorfiles

    log.info("starting from the %s checkpoint %s", cfg.init.format, cfg.init.path)
    try:
        return pretrained.parameters(cfg.init, cfg.model, trainer.abstract_state["params"])
    except (hf_config.Unsupported, tensorfiles.BadFile, pretrained.Mismatch, FileNotFoundError) as exc:
        raise exits.UserError(f"spec.model.init: {exc}") from exc


def setup(cfg: TrainerConfig, *, peak_flops_per_device: float, clock: Clock | None = None) -> Run:
    """Mesh, step, and the state to start from: the latest complete checkpoint when resuming."""
    t = cfg.training
    mesh = sharding.make_mesh(cfg.mesh.shape, cfg.slices)
    log.info("mesh %s over %d devices (%d processes)", cfg.mesh, mesh.size, jax.process_count())
    trainer = build(cfg, mesh)
    ckpt = (
        Checkpointer(cfg.checkpoint.directory, cfg.checkpoint.keep, data_fingerprint(t))
        if cfg.checkpoint.directory
        else None
    )
    if ckpt and cfg.checkpoint.resume and ckpt.latest_step() is not None:
        state, saved = ckpt.restore(trainer.abstract_state)
        check_data_unchanged(saved, ckpt.fingerprint, t.data.allow_change, ckpt.latest_step())
    elif cfg.init is not None:  # a new run from given parameters; a resume above always wins
        state = trainer.start_from(initial_params(cfg, trainer))
    else:
        state = trainer.init()
    sharding.check_shardings(state["params"], trainer.param_shardings)
    sharding.check_state_bytes(state, sharding.state_bytes(trainer.abstract_state, mesh), mesh)
    start = int(jax.device_get(state["step"]))
    skipped = divergence.skipped_at_start(cfg, start, ckpt.skipped if ckpt else 0)
    if ckpt:
        ckpt.skipped = skipped  # every later checkpoint records it
    log.info("starting at step %d of %d", start, t.steps)
    clock = clock or Clock()
    clock.start(start)
    batches = data_lib.Batches(
        data_lib.make_source(t, cfg.model.vocab),
        trainer.batch_sharding,
        cfg.mesh.context,
        workers=t.data.workers,
        prefetch=t.data.prefetch,
    )
    # The bf16 peak in proportion to the one given (which a CPU run or TPUJOB_PEAK_FLOPS_PER_DEVICE sets).
    bf16 = cfg.peak_bf16_flops_per_device
    return Run(
        cfg=cfg,
        trainer=trainer,
        state=state,
        start=start,
        batches=batches,
        ckpt=ckpt,
        flops_per_step=flops_lib.flops_per_step(cfg.model, t),
        devices=mesh.size,
        peak_flops=peak_flops_per_device * mesh.size,
        clock=clock,
        peak_bf16_flops=peak_flops_per_device * mesh.size * bf16 / cfg.peak_flops_per_device if bf16 else None,
        skipped=skipped,
    )


def reporting_hooks(run: Run, status: metrics_lib.Status, tb: metrics_lib.TensorBoard, main: bool) -> list[Hook]:
    """Evaluation every `eval.interval` steps, the stdout JSON line (process 0), /status and TensorBoard
    every `logEvery` steps, and the checkpoint every `interval` steps."""
    every = run.cfg.training.log_every
    hooks = [
        Hook(every, on_record=lambda r: status.update(**r.as_dict())),
        Hook(every, on_record=lambda r: tb.scalars(r.step, r.as_dict())),
    ]
    if main:
        hooks.append(Hook(every, on_record=lambda r: metrics_lib.emit(r.as_dict())))
    if run.ckpt:
        hooks.append(Hook(run.cfg.checkpoint.interval, on_state=run.save))
    if run.cfg.training.eval is not None:
        hooks.insert(0, evaluation.Evaluator(run.cfg, run.trainer).hook(run.clock))  # its values join the record
    return hooks


def train(run: Run, hooks: list[Hook]) -> Summary:
    """The loop. It never waits for step n before dispatching step n+1: step n's metrics are read after
    n+1 is dispatched, so a step's time is the time between two completions. Step s reads the batch at
    data position s + run.skipped (rewinds, divergence.py)."""
    total = run.cfg.training.steps
    if run.start >= total:
        last = run.ckpt.last_complete_step() if run.ckpt else None
        log.info("already complete: the checkpoint at step %s is the last step (%d)", last, total)
        return Summary(step=run.start, last_checkpoint_step=last, already_complete=True)
    reports = _Reports(run, hooks)
    run.read_through = reports.through
    state = run.state
    for step in range(run.start, total):
        t_data = time.perf_counter()
        batch = run.batches(step + run.skipped)
        run.waited_for_data(time.perf_counter() - t_data)
        state, metrics = run.step_overrides.get(step, run.trainer.step)(state, batch)
        reports.dispatched(step + 1, metrics)  # reports step, before step+1's hooks (a save reads step+1 too)
        for hook in hooks:
            if hook.on_state and hook.due(step + 1, total):
                hook.on_state(step + 1, state)
    reports.through(total)
    last = run.clock.finish_checkpoints(run.ckpt) if run.ckpt else None
    timed = reports.times[1:] or reports.times
    median = statistics.median(timed)
    return Summary(
        step=total,
        last_checkpoint_step=last,
        loss=reports.record.loss,
        step_time_s=median,
        global_tokens_per_s=run.tokens_per_step / median,
        mfu=run.flops_per_step / median / run.peak_flops,
        steps_timed=len(timed),
    )


class _Reports:
    """The steps dispatched and not yet read, read in order: by the loop one step behind dispatch, and
    by `Run.save` up to the step it saves (`through`). Reading a step runs its record hooks, and at a
    non-finite step ends the run (`_diverged`)."""

    def __init__(self, run: Run, hooks: list[Hook]):
        self.run, self.hooks = run, hooks
        self.unread: list[tuple[int, dict]] = []
        self.times: list[float] = []
        self.record: StepRecord | None = None
        self.t_prev = time.perf_counter()

    def dispatched(self, step: int, metrics: dict) -> None:
        self.through(step - 1)
        self.unread.append((step, metrics))

    def through(self, step: int) -> None:
        while self.unread and self.unread[0][0] <= step:
            self._read(*self.unread.pop(0))

    def _read(self, step: int, metrics: dict) -> None:
        run = self.run
        values = {k: float(v) for k, v in jax.device_get(metrics).items()}  # blocks until step `step` is done
        now = time.perf_counter()
        self.times.append(now - self.t_prev)
        due = [hook for hook in self.hooks if hook.due(step, run.cfg.training.steps)]
        extra = {k: v for hook in due if hook.values for k, v in hook.values(step).items()}
        self.record = run.record(step, values, now - self.t_prev, extra)
        self.t_prev = now
        finite = bool(values["finite"])
        # A step with an evaluation is reported whatever logEvery says, and so is a non-finite one:
        # /status, the JSON line and TensorBoard show the NaN itself, never the last healthy value.
        for hook in self.hooks:
            if hook.on_record and (hook in due or extra or not finite):
                hook.on_record(self.record)
        if not finite:
            self._diverged(step, values)

    def _diverged(self, step: int, values: dict) -> None:
        """Every process gets here at the same step (the flag is replicated). The saves in flight hold
        earlier, finite steps: they finish, and the rewind restores the latest."""
        run = self.run
        last = run.clock.finish_checkpoints(run.ckpt) if run.ckpt else None
        failure = divergence.diverged_at(step, values, last)
        if run.ckpt and jax.process_index() == 0:
            marker = divergence.write_marker(
                run.cfg.checkpoint.directory, failure.divergence, run.skipped, run.cfg.divergence.skip_batches
            )
            log.info("divergence marker: %s", marker)
        raise failure


def tensorboard_dir(cfg: TrainerConfig, run_dir: str | None) -> str | None:
    """Where process 0 writes TensorBoard's files (scalars here, profiles in profiling.py)."""
    base = cfg.checkpoint.directory or run_dir
    return f"{base.rstrip('/')}/tensorboard" if base else None


def run(
    cfg: TrainerConfig,
    *,
    peak_flops_per_device: float,
    run_dir: str | None = None,
    status: metrics_lib.Status | None = None,
    clock: Clock | None = None,
    extra_hooks: Callable[[Run], list[Hook]] | None = None,
) -> Summary:
    """Train `cfg` on all global devices; every process returns the summary, process 0 prints it.
    `extra_hooks(run)` run before the reporting and checkpoint hooks (SIGTERM handling, test faults)."""
    main = jax.process_index() == 0
    status = status or metrics_lib.Status(cfg.training.steps, jax.process_count())
    prepared = setup(cfg, peak_flops_per_device=peak_flops_per_device, clock=clock)
    tb = metrics_lib.TensorBoard(tensorboard_dir(cfg, run_dir) if main else None)
    try:
        hooks = [*(extra_hooks(prepared) if extra_hooks else []), *reporting_hooks(prepared, status, tb, main)]
        summary = train(prepared, hooks)
    finally:
        tb.close()
        prepared.batches.close()
        if prepared.ckpt:
            prepared.ckpt.close()
    status.update(**{k: getattr(summary, k) for k in metrics_lib.STEP_KEYS if hasattr(summary, k)}, state="completed")
    if main:
        metrics_lib.emit(summary.as_dict())
    return summary
