"""errors.py: one table of error kinds -> wire codes, HTTP statuses, exit statuses."""
from kestreld import errors


def test_the_protocols_closed_set_of_codes():
    assert errors.WIRE_CODES == ("bad_request", "unknown_method", "too_large", "prompt_too_long",
                                 "queue_full", "shutting_down", "cancelled", "permission_denied",
                                 "internal")
    kinds = errors.REQUEST_ERRORS
    assert len({k.code for k in kinds}) == len(kinds)
    exits = [k.exit_status for k in kinds if k.exit_status is not None]
    assert len(set(exits)) == len(exits) == len(errors.EXIT_STATUS)   # kestrelctl tells them apart
    assert all(k.wire or k.exit_status is None or k is errors.Unavailable for k in kinds)
    assert all(400 <= k.http_status < 600 for k in kinds)
    assert errors.EXIT_STATUS["unavailable"] == 11 and not errors.Unavailable.wire
    assert errors.BY_CODE["queue_full"] is errors.QueueFull


def test_anything_else_becomes_internal():
    e = errors.QueueFull("4 waiting")
    assert errors.internal(e) is e and errors.to_wire(e) == {"code": "queue_full", "message": "4 waiting"}
    wrapped = errors.internal(ZeroDivisionError("boom"))
    assert isinstance(wrapped, errors.InternalError)
    assert errors.to_wire(ZeroDivisionError("boom")) == {
        "code": "internal", "message": "internal error: ZeroDivisionError: boom"}
    assert issubclass(errors.ModelLoadError, errors.FatalError) and errors.FatalError.exit_status == 1


def test_http_codes_are_openais_where_it_has_one():
    assert errors.PromptTooLong.http_code == "context_length_exceeded"
    assert errors.PromptTooLong("x").to_wire()["code"] == "prompt_too_long"   # the RPC's own
    assert errors.ModelNotFound.http_code == "model_not_found" == errors.ModelNotFound.code
    assert all(k.http_code == k.code for k in errors.REQUEST_ERRORS
               if k is not errors.PromptTooLong)
