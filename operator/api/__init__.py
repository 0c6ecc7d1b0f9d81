"""The TPUTrainingJob API: what a job is, whether it is valid, and what follows from it.

  contract    the TrainerConfig the renderer writes and the trainer reads (imports pydantic only)
  models      the job: spec sections, the whole object, the status
  rules       cross-field rules, run on whatever sections validated
  catalogue   TPU generations and the slices each offers
  presets     named model shapes
  plan        derived numbers: chips, hosts, devices, peak FLOP/s, the TrainerConfig
  names       deterministic names and labels of everything a job owns
  profiling   profile requests (annotation, --profile, POST /profile) and the trainer's report (pydantic only)
  validation  reading files, parsing documents, collecting every problem
  problems    pydantic errors as `field.path: reason` lines
  crd         the CRD, generated from the models
  capacity    optional online check that a zone offers the slice

Nothing here imports kopf, kubernetes or jinja2: the trainer imports `contract`, and the CLI's
offline commands need no cluster client.
"""
