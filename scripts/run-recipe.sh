# Sourced by train.sh and translate.sh: `run_recipe TOOL ARGS...` becomes multipath_nmt/recipe.py's
# shell_main, run as a file (runpy) so that it starts without importing fairseq; it prints the
# plan and the command, then runs it (or prints one error line).
run_recipe() {
    local python=${PYTHON:-python}
    exec "$python" -c 'import importlib.util, os, runpy, sys
spec = importlib.util.find_spec("multipath_nmt")
if spec is None:
    sys.exit(f"{sys.argv[2]}: error: {sys.argv[1]} cannot import multipath_nmt; activate its environment or set PYTHON")
sys.argv[1:] = sys.argv[2:]
runpy.run_path(os.path.join(spec.submodule_search_locations[0], "recipe.py"), run_name="__main__")' \
        "$python" "$@"
}
