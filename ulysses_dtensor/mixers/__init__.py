"""Token mixers besides attention, on a rank's whole sequence, restarting at packed
documents' starts as if each document ran alone.

* :mod:`.dispatch`: the ops as the mixers call them (gated delta rule, causal conv,
  Mamba-2 and Mamba scans): a GPU kernel where one computes the same result, else torch;
* :mod:`.kernel_choice`: which kernel runs each op, and why (the table, the banner line);
* :mod:`.fla_kernels`, :mod:`.mamba_kernels`: the calls into fla-core, causal-conv1d and
  mamba-ssm, with packed documents as their ``cu_seqlens`` / ``seq_idx``;
* :mod:`.gated_delta`: the gated delta rule (chunked) and the short causal convolution,
  pure torch;
* :mod:`.ssm_scan`: the Mamba-2 (SSD) and Mamba (selective) state-space scans, pure torch.

The building blocks under ``integrations.hf.mixers`` (which adds the exchange) as
``attention/`` is under the attention styles.
"""
