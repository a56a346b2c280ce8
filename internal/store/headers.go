package store

import "encoding/json"

// HeaderMap is a message's headers as stored (jsonb), read for operators tolerantly: the
// producers store an object of string arrays, but a row written some other way (by hand, by
// another tool) may hold anything — the relay makes such a row dead on sight — and listing or
// showing it must not fail the whole command. A string value becomes a one-element list, any
// other value its JSON text; a value that is not an object becomes the one header "(headers)"
// holding its JSON text.
type HeaderMap map[string][]string

// UnmarshalJSON reads b as described on HeaderMap; it never fails.
func (h *HeaderMap) UnmarshalJSON(b []byte) error {
	var obj map[string]json.RawMessage
	if err := json.Unmarshal(b, &obj); err != nil {
		*h = HeaderMap{"(headers)": {string(b)}}
		return nil
	}
	if obj == nil { // JSON null
		*h = nil
		return nil
	}
	out := make(HeaderMap, len(obj))
	for k, raw := range obj {
		var list []string
		if err := json.Unmarshal(raw, &list); err == nil {
			out[k] = list
			continue
		}
		var s string
		if err := json.Unmarshal(raw, &s); err == nil {
			out[k] = []string{s}
			continue
		}
		out[k] = []string{string(raw)}
	}
	*h = out
	return nil
}
