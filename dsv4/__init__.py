"""DeepSeek-V4 in Flax NNX: config, model, checkpoint I/O, FP8/FP4 formats."""

from dsv4.config import ConfigError, DSV4Config
from dsv4.io.convert import save_hf_checkpoint
from dsv4.io.load import load_hf_checkpoint
from dsv4.model import DSV4ForCausalLM, DSV4Output, abstract_model, count_params

__all__ = ["ConfigError", "DSV4Config", "DSV4ForCausalLM", "DSV4Output", "abstract_model", "count_params",
           "load_hf_checkpoint", "save_hf_checkpoint"]
