"""The quick tier (`bash scripts/run_tests.sh -m quick`): every module once, in about a minute.

For the inner loop. Each parity property runs at its smallest mesh (sp 2, or the
smallest the property needs); the full suite (what CI runs) adds the larger meshes,
the trainer trajectories, the planner searches, restarts and the benchmarks' smoke
runs. conftest.py marks what is listed here `quick` and fails the collection when an
entry names a test that no longer exists, so the list cannot rot silently.
"""

from __future__ import annotations

# Files whose every test is quick (unit tests, single process, or one small mesh).
WHOLE_FILES = {
    "test_attention.py",
    "test_attention_patterns.py",
    "test_attention_planning.py",
    "test_batch.py",
    "test_config.py",
    "test_cuda_calls_on_cpu.py",
    "test_data.py",
    "test_data_checks.py",
    "test_data_mixture.py",
    "test_data_packing.py",
    "test_data_store.py",
    "test_doc_sources.py",
    "test_docs.py",
    "test_family_check.py",
    "test_family_table.py",
    "test_gpu_check.py",
    "test_hf_causal_lm.py",
    "test_hf_rope.py",
    "test_kernel_table.py",
    "test_layout.py",
    "test_quick_tier.py",
    "test_regions.py",
    "test_llama.py",
    "test_memory_features.py",
    "test_memory_options.py",
    "test_nonfinite.py",
    "test_norm.py",
    "test_rope.py",
    "test_schedule.py",
    "test_sft_data.py",
    "test_sft_training.py",
    "test_sp_training.py",
    "test_ssm_scan.py",
    "test_tensor_parallel.py",
}

# From the larger files: the smallest mesh of each property, and the refusals.
TESTS = {
    "test_ulysses.py": [
        "test_attention_parity_with_single_process[2]",
        "test_exchange_is_minimal_all_to_all[2]",
        "test_patterns_and_mla_through_the_exchange[2]",
        "test_bad_input_raises_clear_errors",
    ],
    "test_parallelize.py": ["test_bad_options_are_clear_errors"],
    "test_float8.py": [
        "test_halves_of_a_sequence_equal_the_whole[tensorwise-True-True]",
        "test_refusals_name_what_would_be_valid",
    ],
    "test_trl_user_data.py": [
        "test_every_format_reads_the_rows_written_text_and_messages",
        "test_what_cannot_be_used_is_refused_in_one_message",
        "test_reward_functions_load_from_a_file_and_bad_names_are_refused",
    ],
    "test_head_chunks.py": [
        "test_chunks_follow_the_kv_groups",
        "test_bad_chunk_counts_are_refused_by_name",
        "test_auto_count_from_the_shapes_and_the_banner",
        "test_split_kernels_equal_the_kernel_under_autograd",
        "test_cuda_split_kernels_compute_the_cpu_kernels_values",
    ],
    "test_ring.py": ["test_trainer_losses_mesh_independent_with_ring"],
    "test_hf_integration.py": [
        "test_unsupported_models_and_inputs_are_refused_by_name",
        "test_example_hf_custom_loop_trains_loads_and_saves",
    ],
    "test_hf_memory.py": [
        "test_what_the_ring_and_tiling_cannot_run_is_refused_by_name",
        "test_usp_ring_matches_unsharded_for_causal_families",
    ],
    "test_hf_linear_attention.py": [
        "test_hybrid_models_match_unsharded_on_every_mesh[2]",
        "test_gated_delta_restarts_equal_each_document_alone",
        "test_other_hybrids_are_refused_by_class_and_layer_type",
    ],
    "test_mixer_kernels.py": [
        "test_decision_table",
        "test_inside_torch_compile_the_torch_code_runs",
        "test_banner_says_what_runs_and_why",
        "test_mixers_of_a_model_name_their_ops",
        "test_on_cpu_no_kernel_package_is_imported",
        "test_kernel_paths_compute_what_the_torch_path_computes",
        "test_cu_seqlens_are_built_once_per_batch",
    ],
    "test_hf_checkpoint.py": [
        "test_hf_config_errors_name_the_value_and_what_is_supported",
        "test_library_imports_without_the_hf_extra",
        "test_logits_match_transformers_on_plain_rows_and_packed_documents",
        "test_export_round_trip_every_family_and_our_own_flavor",
    ],
    "test_checkpoint.py": [
        "test_kill_during_save_never_looks_complete",
        "test_keep_latest_k_and_interval",
        "test_incomplete_checkpoint_ignored",
    ],
    "test_lora.py": [
        "test_refusals_name_the_key_and_what_is_valid",
        "test_planner_counts_adapter_state_only_and_a_bf16_base",
    ],
    "test_trainer_transformers.py": [
        "test_implementation_key_choices_and_refusals",
        "test_memory_planner_traces_the_transformers_model",
    ],
    "test_torchtitan_plugin.py": ["test_configs_and_errors", "test_parity_sp2"],
    "test_disk_offload.py": [  # one process; the meshes and the trainers' runs in the full suite
        "test_disk_gives_the_host_offload_bytes_within_the_staging_bound",
        "test_fake_and_meta_tensors_count_bytes_and_touch_no_disk",
        "test_unusable_directories_and_too_little_space_are_refused",
        "test_a_full_disk_mid_run_stops_with_the_message",
        "test_no_file_outlives_a_killed_process",
        "test_banner_states_the_staging_area_and_the_disk_bytes",
    ],
    "test_save_attention.py": [  # all but the compiled step (10 s of tracing)
        "test_kept_ops_cover_every_attention_kernel_of_this_torch",
        "test_varlen_attn_dispatches_a_kept_op",
        "test_varlen_attn_output_is_kept_and_its_gradients_exact",
        "test_flex_attention_reaches_the_checkpoint_modes",
        "test_checkpoint_storage_layout_is_what_offload_reads",
        "test_kept_outputs_are_read_from_the_list_layout_of_torch_2_11",
        "test_offloader_brings_back_the_kept_outputs_with_the_block_input",
        "test_a_forward_that_keeps_nothing_warns_once",
        "test_llama_save_attention_matches_no_ac_and_runs_attention_once",
        "test_save_attention_needs_full_ac",
        "test_config_refuses_save_attention_without_full_ac",
        "test_trainer_banner_says_what_is_kept_and_where",
    ],
    "test_hf_trainer.py": [
        "test_sft_lora_sp2_checkpoints_and_resumes",
        "test_training_arguments_that_cannot_run_are_refused_by_name",
        "test_training_arguments_translate_to_the_parallelize_options",
        "test_batches_that_cannot_run_are_refused_and_right_padding_runs",
    ],
    "test_estimate_kernels.py": ["test_plain_causal_on_hopper_plans_cudnn_and_a_named_backend_is_checked_on_that_gpu"],
    "test_policy_blocks.py": [  # one process; the 2-rank checks and the docs' loop in the full suite
        "test_token_stats_are_those_of_log_softmax_and_zero_without_a_target",
        "test_chunked_token_stats_equal_the_whole_values_and_gradients",
        "test_packed_rows_keep_each_rows_real_tokens_and_put_values_back",
        "test_grpo_loss_refuses_what_it_cannot_compute",
        "test_grpo_planning_is_for_the_transformers_trainer",
    ],
    "test_trl_grpo.py": ["test_generation_batch_counts_data_parallel_ranks_and_refuses_uneven_shares"],
    "test_estimate.py": [
        "test_dtensor_shape_propagation_is_not_counted",
        "test_cli_reports_a_bad_config_clearly",
    ],
    "test_estimate_speed.py": ["test_cli_states_the_precision_and_the_binding_ceiling"],
    "test_estimate_disk.py": ["test_modelled_disk_seconds_are_bytes_over_bandwidth_and_exposed_past_compute"],
    "test_estimate_float8.py": ["test_a_gpu_without_fp8_is_refused_by_name"],
    "test_qk_norm_recompute.py": [  # one 2-rank launch: the send layout and head chunks run
        "test_the_norms_keep_the_normed_input_not_the_projections",
        "test_recomputed_norm_inputs_change_no_number",
    ],
    "test_evaluation.py": [
        "test_held_out_split_never_read_by_training",
        "test_generators_exact_position_length_determinism",
        "test_report_rows_round_trip_and_redraw_the_plots",
    ],
    "test_eval_trainer.py": ["test_eval_config_errors"],
    "test_metrics_mesh.py": ["test_throughput_formula"],
    "test_family_matrix.py": [
        "test_results_cover_the_installed_transformers",
        "test_every_refused_family_is_refused_with_its_reason",
    ],
    "test_restarts.py": [
        "test_comm_section_defaults_and_bad_values",
        "test_lost_peer_line_names_step_phase_and_collective",
        "test_restart_store_needs_the_variable_with_several_agents",
        "test_resumed_metrics_replace_the_rows_after_the_checkpoint",
        "test_fault_latch_is_whole_when_it_appears_and_fires_once",
    ],
    "test_rope_training.py": ["test_shipped_context_extension_configs_validate"],
    "test_versions.py": [  # the checks on the standard library's members; not the imports of the libraries
        "test_another_version_with_every_member_warns_once",
        "test_only_local_rank_0_warns",
        "test_a_missing_member_is_refused_by_name",
        "test_the_override_turns_the_refusal_into_a_warning",
        "test_a_library_that_is_not_installed_is_left_to_its_import",
        "test_tested_versions_are_pyprojects_pins_and_the_installed_ones",
    ],
    "test_known_errors.py": [  # the mechanism in one process; the torchrun launches are not quick
        "test_one_rank_per_node_and_attempt_reports",
        "test_sigterm_while_reporting_waits_for_the_message",
        "test_known_errors_exit_with_one_message_and_their_status",
        "test_an_uncaught_ulysses_trainer_error_is_one_line_and_others_keep_their_traceback",
        "test_a_checkpoint_the_trainer_cannot_resume_from_is_one_line",
    ],
}

# Modules no file of the tier imports by name (tests/test_quick_tier.py finds those that
# are), and the quick test that runs them.
THROUGH = {
    # The exchange in the send layout and head chunks, on sp 2 (our Llama's q/k/v projections).
    "ulysses_dtensor.parallel.grouped_exchange": "test_qk_norm_recompute.py::test_recomputed_norm_inputs_change_no_number",
    "ulysses_dtensor.parallel.head_chunks": "test_qk_norm_recompute.py::test_recomputed_norm_inputs_change_no_number",
    # "auto" sizes fitted to the world: every world size from 1 to 8, and the refusals.
    "ulysses_dtensor.trainer.mesh_fit": "test_config.py::test_default_config_fits_every_world",
    # One ring block's steps, forward and backward: what every ring test runs.
    "ulysses_dtensor.parallel.ring_steps": "test_ring.py::test_trainer_losses_mesh_independent_with_ring",
    "ulysses_dtensor.data.chat": "test_sft_data.py",  # the chat templates
    "ulysses_dtensor.data.order": "test_data.py",  # the epoch order of the stream
    "ulysses_dtensor.data.readers": "test_data_checks.py",  # every file format read and checked
    "ulysses_dtensor.estimate.tracker": "test_trainer_transformers.py::test_memory_planner_traces_the_transformers_model",
    "ulysses_dtensor.export.files": "test_hf_checkpoint.py::test_export_round_trip_every_family_and_our_own_flavor",
    "ulysses_dtensor.export.transformers": "test_hf_rope.py::test_trainer_stage_ropes_on_a_transformers_model",
    "ulysses_dtensor.evaluation.plots": "test_evaluation.py::test_report_rows_round_trip_and_redraw_the_plots",
    "ulysses_dtensor.export.native": "test_hf_checkpoint.py::test_export_round_trip_every_family_and_our_own_flavor",
    "ulysses_dtensor.integrations.hf.checkpoint_io": "test_hf_integration.py::test_example_hf_custom_loop_trains_loads_and_saves",
    # UlyssesSFTTrainer's run: the Trainer's accelerator over the data-parallel ranks.
    "ulysses_dtensor.integrations.hf.ulysses_trainer.accelerator": "test_hf_trainer.py::test_sft_lora_sp2_checkpoints_and_resumes",
    # Its guard between the gradient norm and the optimizer step, at every step of the same run.
    "ulysses_dtensor.integrations.hf.ulysses_trainer.nonfinite_steps":
        "test_hf_trainer.py::test_sft_lora_sp2_checkpoints_and_resumes",
    "ulysses_dtensor.integrations.hf.mixers.gated_delta_net":
        "test_hf_linear_attention.py::test_gated_delta_restarts_equal_each_document_alone",
    "ulysses_dtensor.integrations.hf.mixers.mamba": "test_hf_linear_attention.py::test_hybrid_models_match_unsharded_on_every_mesh[2]",
    "ulysses_dtensor.integrations.hf.mixers.short_conv":
        "test_hf_linear_attention.py::test_hybrid_models_match_unsharded_on_every_mesh[2]",
    "ulysses_dtensor.integrations.hf.mixers.style":
        "test_hf_linear_attention.py::test_hybrid_models_match_unsharded_on_every_mesh[2]",
    "ulysses_dtensor.mixers.mamba_kernels":
        "test_mixer_kernels.py::test_kernel_paths_compute_what_the_torch_path_computes",
    "ulysses_dtensor.integrations.hf.moe": "test_hf_memory.py::test_usp_ring_matches_unsharded_for_causal_families",
    "ulysses_dtensor.integrations.hf.positions": "test_hf_memory.py::test_usp_ring_matches_unsharded_for_causal_families",
    "ulysses_dtensor.parallel.comm_timing": "test_ring.py::test_trainer_losses_mesh_independent_with_ring",
    "ulysses_dtensor.runtime.process_group": "test_ring.py::test_trainer_losses_mesh_independent_with_ring",
    "ulysses_dtensor.runtime.suggest": "test_config.py",  # "did you mean" on a mistyped key
    "ulysses_dtensor.trainer.data_config": "test_config.py",
}
