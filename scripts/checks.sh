# Checks the suite scripts share (sourced): one line on stderr and exit 1 before any work.
whole_numbers() {  # VAR...: each a whole number > 0 (SEED: >= 0); an empty or unset one is skipped
  local var value
  for var in "$@"; do
    value=${!var:-}
    [ -n "$value" ] || continue
    [[ $value =~ ^[0-9]+$ ]] && { [ "$var" = SEED ] || [ "$value" -gt 0 ]; } ||
      { echo "error: $var=$value: want a whole number$([ "$var" = SEED ] || echo ' > 0')" >&2; exit 1; }
  done
}
