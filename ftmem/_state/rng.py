"""The process-wide random number generators a bitwise resume needs back (Python,
numpy, torch CPU and, where present, every CUDA device). Frameworks save some of them
or none; the adapters snapshot these with every version."""
from __future__ import annotations

import random

import numpy as np
import torch


def rng_states() -> dict:
    states = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict) -> None:
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
