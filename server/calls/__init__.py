"""What every call goes through: admission, the in-flight registry (cancel, deadline, disconnect), request scopes and records, request decoding."""
