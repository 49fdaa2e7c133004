"""Every flag of train.py's parser is seen to act: ACTS names, per flag, the test that fails when the flag does
nothing (it sets the flag and checks where the effect lands: a file, a request, a logged number, an error; not that
it parses). A flag without an entry, an entry the parser lacks or a test that does not exist fails here. A flag goes
by its first spelling. UNTESTED: the flags with no such test yet, and why."""
import ast
import os
import warnings

import flags
from conftest import ROOT

ACTS = {
    # model and data
    "--model": "tests/test_step.py::test_a_model_not_on_disk_is_named_in_seconds_with_how_to_download_it",
    "--train_data": "tests/test_data.py::test_the_data_check_phase_sets_the_limits_on_every_rank_or_stops_them",
    "--val_data": "tests/test_data.py::test_a_validation_file_with_no_usable_sample_is_refused",
    "--tiny_task": [
        "tests/test_step.py::test_parse_args_tiny_defaults_only_without_model",
        "tests/test_e2e.py::test_grounding_demo_learns",
    ],
    "--tiny_arch": [
        "tests/test_step.py::test_each_family_gets_its_grid_its_cpu_dtype_and_unknown_ones_a_clear_error",
        "tests/test_resume.py::test_resume_exact_with_one_process_and_the_export_loads",
    ],
    "--tiny_size": "tests/test_flags_act.py::test_the_tiny_size_is_the_model_the_run_plans",
    "--output_dir": "tests/test_logs.py::test_a_few_trajectories_and_the_images_the_model_saw_go_to_the_run_folder",
    "--image_root": "tests/test_e2e.py::test_text_only_rank_beside_an_image_rank",
    "--columns": "tests/test_data.py::test_check_source_reads_hf_sources_without_decoding_an_image",
    "--check_data": "tests/test_data.py::test_check_data_alone_names_an_img_key_without_loading_a_model",
    "--system_prompt": "tests/test_flags_act.py::test_the_system_prompt_opens_the_prompt",
    "--question_template": "tests/test_flags_act.py::test_the_question_template_shapes_the_users_text",
    # GRPO
    "--num_generations": "tests/test_step.py::test_rollout_gives_one_group_per_prompt",
    "--num_iterations": "tests/test_step.py::test_old_and_ref_logps_only_when_needed",
    "--rollout_batch_size": "tests/test_flags_act.py::test_rollout_batch_size_is_the_prompts_a_step_rolls_out",
    "--per_device_train_batch_size": "tests/test_step.py::test_micro_batches_carry_what_the_update_needs",
    "--shared_prefix": [
        "tests/test_step.py::test_shared_prefix_micro_batches_keep_a_group_in_one_row",
        "tests/test_step.py::test_micro_batches_pad_to_their_own_longest",
    ],   # on, and off
    "--micro_batch_tokens": "tests/test_step.py::test_a_token_budget_fills_micro_batches_by_padded_size",
    "--max_micro_batch": "tests/test_flags_act.py::test_max_micro_batch_caps_the_derived_micro_batch",
    "--learning_rate": "tests/test_deepspeed.py::test_each_optimizer_step_uses_the_logged_rate",
    "--warmup_steps": "tests/test_deepspeed.py::test_each_optimizer_step_uses_the_logged_rate",
    "--lr_scheduler_type": "tests/test_deepspeed.py::test_each_optimizer_step_uses_the_logged_rate",
    "--weight_decay": "tests/test_checkpoint.py::test_a_relaunch_trains_at_its_own_learning_rate_and_weight_decay",
    "--optimizer": "tests/test_flags_act.py::test_the_deepspeed_config_takes_its_flags",
    "--max_grad_norm": "tests/test_flags_act.py::test_the_deepspeed_config_takes_its_flags",
    "--max_steps": [
        "tests/test_deepspeed.py::test_each_optimizer_step_uses_the_logged_rate",
        "tests/test_e2e.py::test_flags_run_end_to_end",
    ],   # the schedule's end, and the run's
    "--max_prompt_length": "tests/test_data.py::test_overlong_prompt_error_mode_stops_the_run",
    "--overlong_prompt": "tests/test_flags_act.py::test_overlong_prompt_skips_or_stops",
    "--max_completion_length": "tests/test_flags_act.py::test_max_completion_length_is_what_vllm_may_write",
    "--temperature": "tests/test_step.py::test_top_k_and_top_p_reach_vllm_and_the_trainer_as_one_record",
    "--temperature_end": "tests/test_hooks.py::test_temperature_end_reaches_vllm_and_the_trainer",
    "--top_p": "tests/test_step.py::test_top_k_and_top_p_reach_vllm_and_the_trainer_as_one_record",
    "--top_k": "tests/test_step.py::test_top_k_and_top_p_reach_vllm_and_the_trainer_as_one_record",
    "--beta": "tests/test_step.py::test_kl_in_reward_moves_the_kl_from_the_loss_into_the_advantages",
    "--ref_ema": "tests/test_hooks.py::test_the_paper_changes_run_and_resume_exactly",
    "--kl_in_reward": "tests/test_step.py::test_kl_in_reward_moves_the_kl_from_the_loss_into_the_advantages",
    "--epsilon": "tests/test_flags_act.py::test_epsilon_clips_the_ratio",
    "--entropy_coef": "tests/test_step.py::test_each_loss_flag_changes_the_update",
    "--sft_coef": "tests/test_hooks.py::test_sft_loss_is_one_mean_over_the_gold_tokens_at_any_micro_batch_size",
    "--router_aux_loss_coef":
        "tests/test_moe.py::test_the_aux_loss_coefficient_is_the_checkpoints_when_its_config_turns_it_on",
    "--routing_replay": "tests/test_moe.py::test_the_flag_reaches_the_training_forward",
    "--epsilon_high": "tests/test_flags_act.py::test_epsilon_high_clips_the_ratio_above",
    "--loss_agg": "tests/test_step.py::test_each_loss_flag_changes_the_update",
    "--loss_type": [
        "tests/test_flags.py::test_trls_loss_type_names_set_the_aggregation",
        "tests/test_step.py::test_each_loss_flag_changes_the_update",
    ],   # it sets --loss_agg, which acts
    "--advantage_estimator": "tests/test_hooks.py::test_pass_at_k_gets_its_k_and_matches_the_papers_advantages",
    "--scale_rewards": "tests/test_step.py::test_tp_slices_by_each_ranks_offset_and_broken_invariants_raise",
    "--pass_at_k": "tests/test_hooks.py::test_pass_at_k_gets_its_k_and_matches_the_papers_advantages",
    "--importance_sampling_level": "tests/test_step.py::test_each_loss_flag_changes_the_update",
    "--vllm_importance_sampling_correction": "tests/test_step.py::test_each_loss_flag_changes_the_update",
    "--vllm_importance_sampling_cap": "tests/test_step.py::test_each_loss_flag_changes_the_update",
    "--dynamic_sampling": "tests/test_step.py::test_dynamic_sampling_replaces_zero_spread_groups",
    "--max_num_gen_batches": "tests/test_step.py::test_dynamic_sampling_replaces_zero_spread_groups",
    "--tools": "tests/test_tools.py::test_two_ranks_whose_trajectories_take_different_turns_stay_in_step",
    "--max_turns": "tests/test_flags_act.py::test_max_turns_ends_a_trajectory_that_keeps_calling",
    "--reward_funcs": "tests/test_step.py::test_score_fills_rewards_and_failure_flags_per_group",
    "--plugins": "tests/test_tools.py::test_the_docs_example_plugin_adds_a_tool_and_a_reward",   # both spellings
    "--reward_weights": "tests/test_step.py::test_score_fills_rewards_and_failure_flags_per_group",
    "--reward_model": "tests/test_teacher.py::test_the_likelihood_reward_is_the_mean_log_prob_under_the_reward_model",
    # on-policy distillation
    "--teacher_model": "tests/test_teacher.py::test_the_teachers_log_probs_and_the_advantage",
    "--teacher_coef": "tests/test_teacher.py::test_the_teachers_log_probs_and_the_advantage",
    # an LLM judge
    "--judge_url":
        "tests/test_judge.py::test_the_judge_scores_concurrently_once_per_request_and_answers_while_the_caller_works",
    "--judge_model": "tests/test_flags_act.py::test_judge_model_is_the_model_asked",
    "--judge_template": "tests/test_judge.py::test_a_failed_or_unparsable_judgement_is_unscored_never_zero",
    "--judge_parser": "tests/test_flags_act.py::test_judge_parser_reads_the_reply",
    "--judge_images": "tests/test_judge.py::test_the_judge_sees_the_images_the_policy_saw_on_every_request",
    "--judge_concurrency": "tests/test_flags_act.py::test_judge_concurrency_is_the_requests_in_flight",
    "--judge_timeout_s": "tests/test_flags_act.py::test_judge_timeout_s_bounds_a_request",
    "--judge_retries": "tests/test_flags_act.py::test_judge_retries_asks_again_after_a_503",
    "--judge_api_key_env": "tests/test_flags_act.py::test_judge_api_key_env_names_the_variable_that_holds_the_key",
    "--judge_max_failed_steps":
        "tests/test_judge.py::test_a_judge_killed_mid_run_stops_the_run_saved_and_a_relaunch_resumes",
    # memory and speed
    "--bf16": "tests/test_step.py::test_each_family_gets_its_grid_its_cpu_dtype_and_unknown_ones_a_clear_error",
    "--gradient_checkpointing": "tests/test_flags_act.py::test_gradient_checkpointing_reaches_the_policy",
    "--attn_implementation":
        "tests/test_step.py::test_shared_prefix_eager_path_creates_every_tensor_on_the_inputs_device",
    "--vllm_gpu_memory_utilization": [
        "tests/test_flags_act.py::test_vllms_engine_takes_its_flags",
        "tests/test_planner.py::test_a_vllm_share_that_cannot_hold_the_weights_does_not_fit",
    ],
    "--vllm_tensor_parallel_size": "tests/test_flags_act.py::test_vllms_engine_takes_its_flags",
    "--vllm_cpu_kv_cache_mb": [
        "tests/test_flags_act.py::test_vllms_engine_takes_its_flags",
        "tests/test_e2e.py::test_memory_auto_refuses_on_every_rank_when_nothing_fits",
    ],
    "--vllm_enforce_eager": "tests/test_flags_act.py::test_vllms_engine_takes_its_flags",
    "--vllm_gdn_prefill_backend": "tests/test_gpu_check.py::test_gdn_prefill_backend_flag_reaches_vllms_resolver",
    "--sleep_level": [
        "tests/test_step.py::test_validation_offloads_like_a_rollout_and_a_sync_waits_for_an_optimizer_step",
        "tests/test_flags_act.py::test_vllms_engine_takes_its_flags",
    ],
    "--gc_collect_after_offload": "tests/test_flags_act.py::test_gc_collect_after_offload_collects_around_vllms_sleep",
    "--limit_images": [
        "tests/test_data.py::test_image_root_and_multi_image",
        "tests/test_tools.py::test_a_tool_that_returns_images_gets_an_image_limit_that_shows_them",
    ],
    "--max_pixels": [
        "tests/test_flags_act.py::test_max_pixels_bounds_the_image_the_model_sees",
        "tests/test_rollout.py::test_engine_budget_follows_max_pixels",
    ],   # the pixels, and vLLM's budget
    "--min_pixels": "tests/test_flags_act.py::test_min_pixels_upscales_a_small_image",
    "--limit_videos": "tests/test_video.py::test_too_many_videos_and_videos_off_are_refused_by_name",
    "--video_fps": "tests/test_flags_act.py::test_video_fps_is_the_rate_frames_are_taken_at",
    "--video_max_frames": "tests/test_video.py::test_frames_are_chosen_at_the_rate_on_the_grid_within_the_budget",
    "--video_min_pixels": "tests/test_video.py::test_frames_are_chosen_at_the_rate_on_the_grid_within_the_budget",
    "--video_max_pixels": "tests/test_flags_act.py::test_video_max_pixels_bounds_each_frame",
    "--video_total_pixels": "tests/test_video.py::test_frames_are_chosen_at_the_rate_on_the_grid_within_the_budget",
    "--sync_bucket_mb": "tests/test_flags_act.py::test_sync_bucket_mb_is_the_size_the_weight_sync_gathers",
    "--logprob_chunk_tokens": "tests/test_step.py::test_micro_batches_pad_to_their_own_longest",
    "--zero_offload": "tests/test_deepspeed.py::test_zero_offload_names_the_static_offload_and_the_plan_follows_it",
    "--offload_optimizer": "tests/test_deepspeed.py::test_offload_flags_change_only_what_they_name",
    "--offload_model": "tests/test_deepspeed.py::test_offload_flags_change_only_what_they_name",
    "--ref_offload": "tests/test_flags_act.py::test_ref_offload_places_the_references_shards",
    # LoRA and frozen parts
    "--use_peft": "tests/test_lora.py::test_lora_adapts_the_language_model_and_only_it_trains",
    "--lora_r": "tests/test_lora.py::test_lora_adapts_the_language_model_and_only_it_trains",
    "--lora_alpha": "tests/test_flags_act.py::test_lora_alpha_scales_the_adapter",
    "--lora_dropout": "tests/test_lora.py::test_lora_vision_and_target_flags_act",
    "--lora_target_modules": "tests/test_lora.py::test_lora_vision_and_target_flags_act",
    "--lora_sync": "tests/test_vllm_agreement.py::test_lora_adapter_sync_is_refused_for_moe_on_cpu",
    "--export_merged":
        "tests/test_resume.py::test_lora_resumes_exactly_after_a_kill_and_its_adapter_loads_in_peft_and_vllm",
    "--lora_vision": "tests/test_lora.py::test_lora_vision_and_target_flags_act",
    "--freeze_vision_tower": "tests/test_lora.py::test_frozen_vision_parts_get_no_gradient_and_no_optimizer_state",
    "--freeze_projector": "tests/test_lora.py::test_frozen_vision_parts_get_no_gradient_and_no_optimizer_state",
    # the memory plan
    "--memory": "tests/test_planner.py::test_memory_auto_prints_its_choice_and_the_run_uses_it",
    "--skip_memory_preflight": "tests/test_flags_act.py::test_skip_memory_preflight_starts_what_memory_auto_refuses",
    "--plan": "tests/test_planner.py::test_memory_py_plan_and_train_py_plan",
    # run
    "--seed": [
        "tests/test_flags_act.py::test_the_seed_orders_the_data",
        "tests/test_flags_act.py::test_vllms_engine_takes_its_flags",
    ],   # the data's order, vLLM's sampling
    "--val_freq": "tests/test_e2e.py::test_two_process_run",
    "--val_before_train": "tests/test_flags_act.py::test_val_before_train_validates_at_step_0",
    "--val_only": "tests/test_flags_act.py::test_val_only_validates_and_neither_trains_nor_exports",
    "--report_to": "tests/test_logs.py::test_wandb_mode_is_respected_with_an_api_key",
    "--wandb_project": "tests/test_flags_act.py::test_the_wandb_run_takes_its_project_and_name",
    "--run_name": "tests/test_flags_act.py::test_the_wandb_run_takes_its_project_and_name",
    "--log_completions":
        "tests/test_logs.py::test_a_few_trajectories_and_the_images_the_model_saw_go_to_the_run_folder",
    "--log_completions_steps":
        "tests/test_logs.py::test_a_few_trajectories_and_the_images_the_model_saw_go_to_the_run_folder",
    "--save_steps": "tests/test_resume.py::test_resume_exact_with_one_process_and_the_export_loads",
    "--save_total_limit": "tests/test_flags_act.py::test_save_total_limit_keeps_that_many_checkpoints",
    "--accept_changed_flags": "tests/test_flags_act.py::test_accept_changed_flags_resumes_what_would_be_refused",
    "--accept_changed_data": "tests/test_checkpoint.py::test_changed_data_is_refused_by_name_or_starts_a_fresh_epoch",
    "--resume": "tests/test_flags_act.py::test_resume_names_the_checkpoint_to_go_on_from",
    "--save_final_model": [
        "tests/test_flags_act.py::test_save_final_model_exports_at_the_end",
        "tests/test_planner.py::test_no_checkpoint_phase_when_nothing_is_saved_and_the_host_has_a_margin",
    ],
    "--deepspeed": "tests/test_flags_act.py::test_the_deepspeed_config_takes_its_flags",
    "--ds_set": "tests/test_flags_act.py::test_the_deepspeed_config_takes_its_flags",
    "--local_rank": "tests/test_e2e.py::test_two_process_run",   # DeepSpeed's launcher passes --local_rank=<n>
}
UNTESTED = {}
MOST_UNTESTED = 0   # UNTESTED may only shrink: lower this with it


def parser_flags():
    """{first spelling: every spelling} of each flag of the real parser, argparse's --help aside."""
    return {a.option_strings[0]: a.option_strings for a in flags.build_parser()._actions
            if a.option_strings and a.dest != "help"}


def test_every_flag_has_a_test_that_sees_it_act():
    missing = sorted(set(parser_flags()) - set(ACTS) - set(UNTESTED))
    assert not missing, f"flags with no entry in ACTS (nor in UNTESTED, with the reason): {' '.join(missing)}"
    assert not set(ACTS) & set(UNTESTED), sorted(set(ACTS) & set(UNTESTED))
    said = f"{len(UNTESTED)} of {len(parser_flags())} flags have no test that sees them act: " + \
        "; ".join(f"{f} ({why})" for f, why in UNTESTED.items())
    print(said)
    if UNTESTED:
        warnings.warn(said)
    assert len(UNTESTED) <= MOST_UNTESTED, "UNTESTED grew: write the flag's test instead"


def test_no_entry_names_a_flag_the_parser_lacks():
    spellings = {s: first for first, all_ in parser_flags().items() for s in all_}
    for flag in [*ACTS, *UNTESTED]:
        assert flag in parser_flags(), (f"{flag} is no flag of flags.build_parser" if flag not in spellings else
                                        f"{flag}: name it by its first spelling, {spellings[flag]}")


def test_every_named_test_exists():
    tests = {}
    for flag, named in ACTS.items():
        for test_id in [named] if isinstance(named, str) else named:
            path, *names = test_id.split("::")
            if path not in tests:
                assert os.path.isfile(os.path.join(ROOT, path)), f"{flag}: no file {path}"
                tree = ast.parse(open(os.path.join(ROOT, path)).read())
                tests[path] = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)} | \
                    {f"{c.name}::{n.name}" for c in tree.body if isinstance(c, ast.ClassDef) for n in c.body
                     if isinstance(n, ast.FunctionDef)}
            name = "::".join(names)
            assert name.split("::")[-1].startswith("test_") and name in tests[path], f"{flag}: no test {test_id}"
