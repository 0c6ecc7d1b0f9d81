"""The TPUTrainingJob API: what a job is, whether it is valid, and what follows from it.

Each module imports only modules listed above it (tests/test_layout_operator.py checks there is no cycle):

  limits      the bounds of every number, string and list a job may carry (the CRD publishes them)
  catalogue   TPU generations and the slices each offers
  presets     named model shapes
  timestamps  RFC 3339 text outside, aware UTC datetimes inside
  backoff     exponential backoff, capped
  names       deterministic names and labels of everything a job owns, JobSet's pod labels
  problems    pydantic errors as `field.path: reason` lines, and several problems joined into one message
  contract    the TrainerConfig the renderer writes and the trainer reads (imports pydantic only)
  lifecycle   how a trainer process ends: exit codes and their default policy, its progress, its record
  profiling   profile requests (annotation, --profile, POST /profile) and the trainer's report (pydantic only)
  trainer_metrics  the trainer's Prometheus series: name, /status key, help (stdlib only; docs.py reads it too)
  roofline    the least time a compiled step can take: each resource's bound on its generation
  spec        the spec's sections (tpu, model, parallelism, runtime, failurePolicy...) and their fields' formats
  rules       cross-field rules, run on whatever sections validated
  failures    the restart policy: a failed attempt's root cause, restart or fail, the backoff, restart counts
  elastic     how many slices an elastic job runs on next (shrink after a lost slice, grow back)
  goodput     the goodput ledger: how much of a job's wall time trained, badput by cause
  models      the whole object: group/version/kind, TPUTrainingJobSpec (sections + rules), metadata
  status      what the operator writes into .status
  derived     what follows from a valid job: chips, hosts, devices, peak FLOP/s, the TrainerConfig (`Plan`)
  validation  reading files, parsing documents, collecting every problem
  crd         the CRD, generated from the spec and status models
  capacity    optional online check that a zone offers the slice

Nothing here imports kopf, kubernetes or jinja2: the trainer imports `contract`, `lifecycle`,
`profiling` and `trainer_metrics`, and the CLI's offline commands need no cluster client.
"""
