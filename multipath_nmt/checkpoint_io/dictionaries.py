"""The dictionary check: a data-bin whose dictionaries do not match a checkpoint's embeddings is
reported with both sizes and both paths before fairseq fails on a tensor shape, and one of the same
size but other symbols (recorded at each save, :func:`dictionary_symbols`) with the first token id
that differs."""
import logging
import os

from multipath_nmt.checkpoint_io import CheckpointError, DictionaryMismatchError
from multipath_nmt.checkpoint_io.reading import _TensorShape, peek_checkpoint

logger = logging.getLogger(__name__)


_EMBEDDINGS = (("source", "encoder.embed_tokens.weight", "source_dictionary", "source_lang"),
               ("target", "decoder.embed_tokens.weight", "target_dictionary", "target_lang"))


# The checkpoint's top-level entry {"source": symbols, "target": symbols} (fairseq keeps unknown
# top-level entries when it loads, and the trainer writes a new one at every save).
DICTIONARIES = "dictionaries"
_USE_THE_TRAINING_DATA = "use the data-bin (and dictionaries) the model was trained on"
_warned_size_only = set()


def _task_dictionary(task, attr):
    try:
        return getattr(task, attr)
    except (AttributeError, NotImplementedError):
        return None


def dictionary_symbols(task):
    """What a checkpoint records of ``task``'s dictionaries (:data:`DICTIONARIES`): each side's
    symbols in token-id order (one list for both sides of a joined dictionary)."""
    recorded = {}
    for side, _, attr, _ in _EMBEDDINGS:
        dictionary = _task_dictionary(task, attr)
        if dictionary is not None:
            symbols = list(dictionary.symbols)
            recorded[side] = next((seen for seen in recorded.values() if seen == symbols), symbols)
    return recorded


def check_dictionaries(path, task):
    """Raise :class:`DictionaryMismatchError` if the task's dictionaries are not those the
    checkpoint was trained with: another size than its embeddings' rows (fairseq fails later on
    a tensor shape), or other symbols than it recorded. A checkpoint that recorded none (stock
    fairseq's, older ones) is checked by size, with a warning."""
    path = str(path)
    if "://" in path or not os.path.isfile(path):
        return
    try:
        state = peek_checkpoint(path)
    except CheckpointError:
        return  # the reader says what is wrong with the file itself
    if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
        return
    recorded = state.get(DICTIONARIES)
    size_only = False
    for side, key, attr, lang_attr in _EMBEDDINGS:
        tensor = state["model"].get(key)
        dictionary = _task_dictionary(task, attr)
        if not isinstance(tensor, _TensorShape) or dictionary is None:
            continue
        rows = tensor.shape[0]
        if rows != len(dictionary):
            raise DictionaryMismatchError(
                path, f"its {side} embedding has {rows} rows but the {side} dictionary "
                      f"{_dictionary_path(task, lang_attr)} has {len(dictionary)} entries: "
                      f"{_USE_THE_TRAINING_DATA}")
        if not isinstance(recorded, dict) or side not in recorded:
            size_only = True
            continue
        differs = next((i for i, (saved, given) in enumerate(zip(recorded[side], dictionary.symbols))
                        if saved != given), None)
        if differs is not None:
            raise DictionaryMismatchError(
                path, f"its {side} dictionary is not {_dictionary_path(task, lang_attr)}, although "
                      f"both have {rows} entries: token id {differs} is {recorded[side][differs]!r} "
                      f"in the checkpoint but {dictionary.symbols[differs]!r} in the data-bin's; "
                      f"{_USE_THE_TRAINING_DATA}")
    if size_only and path not in _warned_size_only:
        _warned_size_only.add(path)
        logger.warning(f"{path} does not record its dictionaries' symbols (saved by stock fairseq or "
                       "an older multipath_nmt): the data-bin's dictionaries are checked by their size only")


def _dictionary_path(task, lang_attr):
    data = getattr(task.cfg, "data", None) if getattr(task, "cfg", None) is not None else None
    lang = getattr(task.cfg, lang_attr, None) if data else None
    if not data:
        return "of the task"
    folder = data.split(os.pathsep)[0]
    return os.path.join(folder, f"dict.{lang}.txt") if lang else f"in {folder}"
