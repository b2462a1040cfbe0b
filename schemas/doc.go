// Package schemas holds every wire type of wmrl and every subject name:
// nothing else hard-codes a subject. The JSON Schema of each message lives
// beside it, for stages written in other languages.
package schemas
