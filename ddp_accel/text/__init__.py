"""Text pipeline: a basic_english-compatible tokenizer, a vocabulary, data sources, length bucketing, models.
It reads its data with Hugging Face datasets: the `text` extra (pip install -e '.[text]')."""

from ddp_accel.text.models import KERNEL_SIZE, STRIDE, TextModelConfig
from ddp_accel.text.pipeline import PadCollate, TextOptions, TextSource, make_loader, prepare_text_data
from ddp_accel.text.tokenizer import basic_english
from ddp_accel.text.vocab import Vocab

__all__ = [
    "KERNEL_SIZE",
    "STRIDE",
    "PadCollate",
    "TextModelConfig",
    "TextOptions",
    "TextSource",
    "Vocab",
    "basic_english",
    "make_loader",
    "prepare_text_data",
]
