"""spirit: lossless self-speculative decoding that adapts online to measured throughput."""

from spirit.api import GenerationResult, Spirit, TextStream, from_pretrained_model, load
from spirit.sampling import SamplingParams
from spirit.skipset import DraftConfig, SkipSet

__version__ = "0.1.0"
__all__ = ["load", "from_pretrained_model", "Spirit", "GenerationResult", "TextStream", "SkipSet",
           "DraftConfig", "SamplingParams", "__version__"]
