"""The training loop: the step built once, a run set up once, and the hooks the loop calls.

train        the train step (`build`), the run's set-up (`setup`), the loop (`train`), its reporting hooks
hooks        what the loop and its hooks share: `Trainer`, `Run`, the `Hook` protocol, `StepRecord`, `Summary`
evaluation   held-out cross entropy and perplexity every `eval.interval` steps (a hook)
checkpoint   Orbax checkpoints: asynchronous saves, keep K, resume onto the current mesh
preemption   SIGTERM: the step in flight finishes and is checkpointed on every process, then exit 143 (a hook)
divergence   a non-finite loss or gradient norm: the exit 43 failure, Rewind's marker and the batches it skips
faults       test-only fault injection (TPUJOB_TEST_*): fail, hang or go NaN at a step (hooks)
progress     the trainer's clock that goodput and hang detection read (`lifecycle.Progress`)
"""
