"""Rendering: a pure function from a validated job to the manifests that run it.

  manifests   the ConfigMap and the JobSet, from the templates in templates/
  libtpu      LIBTPU_INIT_ARGS for a generation and runtime settings
  summary     the readable plan `tpujob validate` prints
"""
