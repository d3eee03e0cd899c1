"""Token mixers besides attention, on a rank's whole sequence (pure torch), restarting
at packed documents' starts as if each document ran alone.

* :mod:`.gated_delta`: the gated delta rule (chunked) and the short causal convolution;
* :mod:`.ssm_scan`: the Mamba-2 (SSD) and Mamba (selective) state-space scans.

The building blocks under ``integrations.hf.mixers`` (which adds the exchange) as
``attention/`` is under the attention styles.
"""
