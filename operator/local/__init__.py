"""The local runner: `tpujob run --local`, a job's rendered JobSet run as processes on this machine.

  run         validate, render, run, and write the status the operator would have written
  pods        the JobSet's pods as processes to start (env, fieldRefs, volumes)
  supervisor  start, watch and restart them with the JobSet failure policy
  report      `tpujob report`: loss, step time and MFU as a PNG
"""
