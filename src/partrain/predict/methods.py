"""Which method measured a profile: ``profile --hardware``'s and the model profiler's, each
numbered, with what every number changed. A profile records the number it was measured by;
one measured by an earlier method is ``stale`` (``predict.profiles``) and is measured again."""

# How ``profile --hardware`` measures, numbered: a profile measured by an earlier method means
# something else by a figure, and is measured again rather than read. 2: ``ddp_allreduce`` is
# DDP on k ranks over DDP on a world of one, no longer over the bare module (it counted DDP's
# world-of-one bookkeeping, which the model profile holds, a second time). 3: the sync after
# computing is a window's mean, as the computing side by side is; the runtime's cost per action
# is timed before the other workers' background load starts. 4: no sync after computing where
# the workers fit on the cores (``profile.hardware.fit_compute_sharing``). 5: with more workers
# than cores, the sync is the probe's whole difference, a hot allreduce's latency not taken off.
# 6: ``ddp_allreduce`` is the plain allreduce's fit plus DDP's excess over it (``predict.fits.fit_excess``).
# 7: emulated links' token bucket holds 1 ms of the rate, not 4 (``testing.netns.tbf_burst``):
# a profile across the old ones timed a link that starts every message at the veth's speed.
# 8: below 500 Mbit/s that bucket is 1 ms of the rate too, not TCP's 64 KiB segments (cut to fit
# it): at 100 Mbit/s the old one let 64 KiB through at once after every pause. 9: the pipeline
# probe's step times are medians of 9 rounds of 10 steps, not 3 of 30 (``measure_pipeline_hops``).
# 10: with 4 or more workers, the probe also runs on every worker at once (``pipeline_side_by_side``)
# 11: ``fsdp_unit``, a ``fully_shard`` unit's collectives as FSDP drives them (``profile.collectives``)
# 12: across nodes of several workers, the collectives over the whole world too (``profile.hardware._tier_plans``)
# 13: with 3 or more workers, the probe also runs as one pipeline over all of them (``pipeline_world``)
# 14: a sweep's point slower than a larger message's is timed again (``profile.collectives.sweep``)
# 15: the pipeline probes over all workers run again over stages that compute (``*_loaded``)
# (A profile of 2-15 may hold ``ddp_allreduce``, DDP's allreduce timed apart: no longer measured,
# and dropped as the profile loads, every other figure the same; ``profile.collectives`` says why.)
# 16: the two-stage probe runs again over stages that compute, and fits ``busy_sender_s``
# 17: on a CPU, every pipeline probe's stages are also timed from cold caches (``stage_cold_s``)
# (18 was a token bucket of 0.3 ms for emulated links, tried in session 60 and taken back)
# 19: on a CPU, with no more workers than cores, a step's synchronisation after computing (``step_sync``)
# 20: across nodes, the same over the whole world (``step_sync`` keyed by the world)
# 21: the step probe's compute is the mean call side by side, not the median (``measure_step_sync``)
# 22: the step probe's rounds visit every compute length in turn, 5 of them, not 3 of one length after another
# 23: the step probe reduces 64 KiB, 1 MiB and 4 MiB (those its link carries in 25 ms), not 64 KiB alone
# 24: a sweep's point far above the line through its neighbours is timed again too (``sweep``)
# 25: the step probe also where the workers outnumber the cores (``step_sync`` for every k), not ``sync_s`` scaled
# 26: the pipeline probes also time each rank's CPU a step, which fits a message's CPU (``pipeline_message_cpu_s``)
# 27: ``busy_sender_s`` is fitted to GPipe's excess over 1F1B in the loaded pair probe, not to their step times
# 28: the loaded pair probe runs 9 rounds, not 3 (``step_probes.PAIR_ROUNDS``): the busy-sender fit swung 0-6 ms
MEASUREMENT = 28
# How the model profiler measures, numbered the same way. 2: FSDP's loop on a world of one
# (``world_of_one_s["fsdp"]``); without it a prediction leaves out FSDP's own bookkeeping.
# 3: a plain module's blocks are the tracer's pieces (``strategies.traced``), not one whole block.
# 4: on a CPU, each block's forward and backward also from cold caches (``BlockProfile.fwd_cold_s``).
# 5: on a CPU, the memory probe's timings at the machine's pace over the whole profile (``probe_pace``).
# 6: on a CPU, the compute sharing factor is the median of each round's own ratio (``profile.sharing``).
# 7: on a CPU, the bare loop at each larger batch size is a multiple of the smallest's step, paired
#    step by step over the probe's rounds (``pace.paired_ratios``), not one run of its own.
# 8: the blocks also as one chain, and its backward into gradients already there (``chain_s``).
# 9: on a CPU, each world-of-one round's steps are multiples of the bare step's windows either side
#    of it (``probe._time_world_of_one``), not seconds of whatever spell the round ran in.
MODEL_MEASUREMENT = 9
