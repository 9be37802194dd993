"""Drivers shared by the robustness tests (crash-resume, distributed, determinism)."""
