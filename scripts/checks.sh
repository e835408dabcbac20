# Checks the suite scripts share (sourced): one line on stderr and exit 1 before any work.
whole_numbers() {  # VAR...: each a whole number > 0 (SEED: >= 0); an empty one is skipped (unset: none)
  local var value
  for var in "$@"; do
    value=${!var:-}  # unset: skipped, under set -u too
    [ -n "$value" ] || continue
    [[ $value =~ ^[0-9]+$ ]] && { [ "$var" = SEED ] || [ "$value" -gt 0 ]; } ||
      { echo "error: $var=$value: want a whole number$([ "$var" = SEED ] || echo ' > 0')" >&2; exit 1; }
  done
}
