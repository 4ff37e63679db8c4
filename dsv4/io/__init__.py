"""Checkpoint I/O: official / transformers-named DeepSeek-V4 safetensors in and out.

  safetensors.py  our safetensors reader / writer (numpy + ml_dtypes; region reads, atomic writes, sharded layout)
  convert.py      the key table official <-> transformers names, `CheckpointError`, the export (`save_hf_checkpoint`)
  plan.py         the read plan of a load: which file tensors fill each model leaf, validated before any read
  read.py         one leaf read by region into its sharding, dequantised on the devices
  load.py         `load_hf_checkpoint`, `load_quantized_state`, `loaded_config`, `init_model`

Parameter names (`dsv4.names`) stay beside the model: the optimizer, the push and the planner key by them too.
"""
