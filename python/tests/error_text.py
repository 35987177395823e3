"""A helper the host and GPU checks share (imported from this folder, not collected by pytest)."""
import symmalloc


def error_of(fn):
    """The message of the ``SymmallocError`` that ``fn()`` raises, or None when it raises none
    (any other exception propagates)."""
    try:
        fn()
    except symmalloc.SymmallocError as e:
        return str(e)
    return None
