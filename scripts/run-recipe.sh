# Sourced by train.sh and translate.sh: `run_recipe TOOL ARGS...` becomes
# multipath_nmt/cli/recipe_scripts.py's main, which prints the plan and the command, then runs it
# (or prints one error line). The recipe and that tool import neither fairseq nor the package's
# __init__ (which imports fairseq for --user-dir: seconds), so a bare package object stands in for
# it here; whatever trains or decodes afterwards is a new process that imports the real one.
run_recipe() {
    local python=${PYTHON:-python}
    exec "$python" -c 'import importlib.util, sys, types
spec = importlib.util.find_spec("multipath_nmt")
if spec is None:
    sys.exit(f"{sys.argv[2]}: error: {sys.argv[1]} cannot import multipath_nmt; activate its environment or set PYTHON")
package = types.ModuleType("multipath_nmt")
package.__path__ = list(spec.submodule_search_locations)
sys.modules["multipath_nmt"] = package
from multipath_nmt.cli.recipe_scripts import main
main(sys.argv[2:])' \
        "$python" "$@"
}
