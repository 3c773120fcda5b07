"""Which parts of a prediction were measured on this machine and which were taken from a file.

On one GPU the model profile is measured here (its blocks, memory and loop on this GPU, at the
precision asked), but what several GPUs cost (links, collectives, each GPU's memory, how many
per node) comes from a cluster file someone wrote by hand, or a hardware profile measured on
the cluster. ``predict`` prints both lists, so that a reader knows what to trust how far.
"""

from __future__ import annotations

from partrain.predict.profiles import HardwareProfile, ModelProfile

FROM_FILE = ("nodes and GPUs per node", "device memory per worker",
             "link bandwidth and latency (collectives derived from them)", "compute speed relative to this machine")


def run_words(profile: ModelProfile) -> str:
    """The device and numerics of a profile, in words: "NVIDIA H100 80GB HBM3, bf16, channels-last"."""
    return ", ".join([profile.device, profile.precision] + ["channels-last"] * profile.channels_last
                     + ["compiled"] * profile.compile)


def provenance(profile: ModelProfile, hardware: HardwareProfile, cluster: str | None = None) -> dict:
    """{"measured": [...], "from_file": [...], "file": path or None}: what came from where;
    ``cluster`` is the file given with --cluster (a TOML description, or a hardware profile
    measured on the cluster)."""
    what = "block times, activation and allocator memory, optimizer, the serial loop"
    measured = [f"model profile of {profile.model} ({run_words(profile)}): {what}"]
    if cluster is not None:
        how = "measured there" if str(cluster).endswith(".json") else "written by hand"
        return {"measured": measured, "from_file": list(FROM_FILE), "file": f"{cluster} ({how})"}
    if hardware.source.startswith("local"):
        measured.append(f"memory per worker ({hardware.description}); one worker needs no collectives")
    else:
        measured.append(f"collectives over {hardware.backend} with {hardware.nodes * hardware.workers_per_node} "
                        f"workers, memory per worker ({hardware.description})")
    return {"measured": measured, "from_file": [], "file": None}


def provenance_lines(prov: dict) -> list[str]:
    lines = ["measured on this machine: " + "; ".join(prov["measured"])]
    if prov["file"]:
        lines.append(f"taken from {prov['file']}: " + "; ".join(prov["from_file"]))
    return lines
