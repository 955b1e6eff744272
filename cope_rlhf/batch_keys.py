"""The per-sample ``Experience.info`` keys between the CoPE experience maker and the policy actor.

The maker (``cope_rlhf.experience_maker``) sets the first three; the policy actor (``cope_rlhf.actor``) takes them out
when the experience is appended, before the replay buffer splits it, so they never reach the log. The replay buffer
carries only ``SIGNALS_KEY``, which ``training_step`` pops.
"""

FORECAST_WEIGHT_KEY = "cope_forecast_weight"  # its forecast samples' weight before the rescale; 0: none
FILTERED_KEY = "cope_filtered"  # the degenerate-group filter took its group: no extrinsic signal, no TE term
INFO_BETA_KEY = "cope_info_beta"  # its group's information-gain gate beta_g
SIGNALS_KEY = "cope_signals_id"  # the id of its frozen signals on this rank
