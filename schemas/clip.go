package schemas

import "unicode/utf8"

// Clip shortens a text field to at most n bytes, keeping both ends around
// " … ": a message's text is bounded, and both ends of a long one matter
// (an execution's detail says how it ended at the start, "exit code 1:",
// and why at the end, the traceback's last line). It never cuts a
// character in two.
func Clip(s string, n int) string {
	const mark = " … "
	if len(s) <= n {
		return s
	}
	if n <= len(mark) {
		return Prefix(s, n)
	}
	keep := n - len(mark)
	head := Prefix(s, keep/3)
	tail := s[len(s)-(keep-len(head)):]
	for len(tail) > 0 && !utf8.RuneStart(tail[0]) {
		tail = tail[1:]
	}
	return head + mark + tail
}

// Prefix is s's longest prefix of at most n bytes that ends on a
// character boundary ("" for n <= 0).
func Prefix(s string, n int) string {
	if len(s) <= n {
		return s
	}
	n = max(n, 0)
	for n > 0 && !utf8.RuneStart(s[n]) {
		n--
	}
	return s[:n]
}
