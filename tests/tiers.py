"""The suite's two tiers. `make test`, the README's command, runs the quick tier: the tests that prove the
most per second, under 5 minutes on 2 CPU cores. `make test-extended` runs the tests named here, which take
a second or more each (CI runs both tiers, so it loses nothing): whole files whose tests start processes of
their own (torchrun ranks, wheels, collections of the suite) or compile a decode step, and single tests whose
quicker siblings stay in the quick tier. tests/conftest.py marks them `extended`.

Chosen from `pytest --durations=0` on a quiet 2-core AMD EPYC (docs/testing.md has the figures): every
test of 1.5 s or more, except three that carry the quick tier's main claims (resume is exact in fp32, the
char_e recipe learns, every path the docs name exists). An entry names a file (all its tests), a test
function (all its parameters) or one parametrized case.
"""

EXTENDED = (
    # whole files: processes of their own, compiled or graphed decode steps
    "tests/training/test_distributed.py",
    "tests/training/test_multinode.py",
    "tests/test_import_modes.py",
    "tests/test_deprecated_imports.py",
    "tests/test_gpu_session.py",
    "tests/policy/test_compiled_decode.py",
    "tests/policy/test_decode_graphs.py",
    "tests/policy/test_static_decode.py",
    "tests/training/test_offload_training.py",
    "tests/optim/test_host_adamw_threads.py",
    "tests/kernels/test_import_name.py",
    "tests/kernels/test_compare_heads.py",
    # single tests (or cases) of a second or more
    "tests/policy/test_decode_attention.py::test_openmp_and_its_own_threads_give_the_same_bits",
    "tests/policy/test_decode_attention.py::test_the_kernel_runs_on_the_openmp_runtime_torch_loaded",
    "tests/training/test_compiled_layers.py::test_compiled_layers_train_like_the_eager_ones",
    "tests/kernels/test_aot.py::test_every_kernel_compiles_at_the_extreme_block_sizes",
    "tests/kernels/test_linear_loss.py::test_variants_at_real_vocabulary_sizes_in_bf16[cpu-triton-sapo-262144]",
    "tests/memory/test_largest.py::test_the_3b_recipe_at_7_5_gib_the_largest_is_qwen2_5_3b",
    "tests/memory/test_plan_vs_profile.py::"
    "test_long_completion_modes_tracked_bytes_agree_with_the_plan_within_10_percent",
    "tests/optim/test_offload_update_thread.py::test_the_process_exits_after_the_handed_over_step_is_done",
    "tests/rewards/test_reward_model.py::test_a_run_learns_from_a_streamed_reward_model",
    "tests/test_api.py::test_import_stays_light",
    "tests/training/test_transfer_counts.py::test_counted_bytes_are_the_planners[1.5b]",
    "tests/training/test_transfer_counts.py::test_counted_bytes_are_the_planners[1.5b-per-micro-batch]",
    "tests/training/test_transfer_counts.py::test_counted_bytes_are_the_planners[4096]",
    "tests/training/test_transfer_counts.py::test_counted_bytes_are_the_planners[8192]",
    "tests/training/test_transfer_counts.py::test_counted_bytes_are_the_planners[offload-weights]",
    "tests/training/test_transfer_counts.py::test_counted_bytes_are_the_planners[offload-weights-untied]",
    "tests/training/test_offload_weights.py::test_an_untied_table_stays_in_host_ram_and_only_its_rows_cross",
    "tests/training/test_offload_weights.py::test_a_resumed_run_continues_exactly",
    "tests/training/test_offload_weights.py::test_streamed_layers_step_bit_for_bit_as_resident_ones[bf16-8bit]",
    "tests/training/test_offload_weights.py::test_the_planner_suggests_the_mode_where_nothing_cheaper_fits",
    "tests/test_cli.py::test_a_recipe_with_a_yaml_syntax_error_is_one_line_from_the_real_command",
    "tests/test_docs.py::test_recipe_header_planner_figures_are_the_planners[llama-3.1-8b_gsm8k_24gb.yaml]",
    "tests/test_docs.py::test_recipe_header_planner_figures_are_the_planners[qwen2.5-7b_gsm8k_24gb.yaml]",
    "tests/test_docs.py::test_recipe_header_planner_figures_are_the_planners[llama-3.1-8b_gsm8k_8gb.yaml]",
    "tests/test_docs.py::test_recipe_header_planner_figures_are_the_planners[qwen2.5-7b_gsm8k_8gb.yaml]",
    "tests/test_docs.py::test_the_path_check_sees_what_it_should",
    "tests/test_trainer_step.py::test_a_tiny_offloaded_run_records_allocator_time_split_pinned_memory_and_plan",
    "tests/test_trainer_step.py::test_the_plan_pins_the_staging_ring_only_where_a_later_gradient_needs_it",
    "tests/training/test_eval_steps.py::test_each_end_evaluation_is_kept_when_a_resumed_run_ends_again",
    "tests/training/test_eval_steps.py::test_resume_neither_repeats_nor_loses_an_evaluation",
    "tests/training/test_faults.py::test_one_ctrl_c_stops_a_hung_reward_function_and_saves_the_last_step",
    "tests/training/test_faults.py::test_sigkill_during_saves_then_resume_continues_exactly",
    "tests/training/test_output_dir.py::test_a_full_disk_during_a_save_is_one_line",
    "tests/training/test_output_dir.py::test_a_live_run_holds_the_folder_and_a_killed_one_leaves_no_lock",
    "tests/training/test_rollout_engine.py::test_the_engine_reads_the_weights_once_the_offloaded_update_has_landed",
    "tests/training/test_trainer.py::test_resume_gives_identical_parameters_and_metrics[bf16_sr-False-cpu]",
    "tests/training/test_trainer.py::test_resume_gives_identical_parameters_and_metrics[bf16_sr-True-stream]",
    "tests/training/test_zero_advantage.py::test_skipping_gives_the_same_parameters[grpo]",
    "tests/training/test_zero_advantage.py::test_skipping_gives_the_same_parameters[gspo-mu2]",
    "tests/training/test_zero_advantage.py::test_skipping_gives_the_same_parameters_optim[bf16_sr-True]",
    "tests/training/test_zero_advantage.py::test_skipping_gives_the_same_parameters_optim[fp32-True]",
)


def extended(nodeid: str) -> bool:
    """Whether a test (its pytest node id) is in the extended tier."""
    return any(matches(entry, nodeid) for entry in EXTENDED)


def matches(entry: str, nodeid: str) -> bool:
    """An entry covers the node id it names and every id below it (a file's tests, a function's cases)."""
    return nodeid == entry or nodeid.startswith((entry + "::", entry + "["))
