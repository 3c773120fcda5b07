"""Profiles the predictor reads: the model (per block, on one worker) and the hardware (collectives)."""

from partrain.profile.collectives import CostFit, Segment, fit_cost, fit_line
from partrain.profile.hardware import HardwareProfile, load_cluster, profile_dir, profile_hardware
from partrain.profile.model import BlockProfile, ModelProfile, load_or_profile, profile_model

__all__ = [
    "BlockProfile", "CostFit", "HardwareProfile", "ModelProfile", "Segment", "fit_cost", "fit_line",
    "load_cluster", "load_or_profile", "profile_dir", "profile_hardware", "profile_model",
]
