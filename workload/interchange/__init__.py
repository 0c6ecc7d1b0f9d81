"""Checkpoints of other implementations in and out: Hugging Face's Llama 3 and Mixtral.

hf_config    config.json to our model shape and back; what our decoder cannot express is refused by key
tensorfiles  safetensors read by byte range (only a shard's bytes) and written, with numpy and fsspec
hf_weights   one rule per parameter (tensor names, axes, transposes), the sharded load, the export's tensors
pretrained   the parameters a new run starts from (spec.model.init): Hugging Face or converted Orbax
commands     `tpujob convert` (Hugging Face to Orbax) and `tpujob export` (a checkpoint to Hugging Face)
"""
