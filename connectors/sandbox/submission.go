package sandbox

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"syscall"
)

// readSubmission reads the file name in dir, the code's, as the grader
// may take it: a file of at most limit bytes, in dir. The code made it
// and the grader runs as wmrl's user (root), so it is opened within dir
// (a symlink that leads out of it is not followed: it could point the
// grader at a file the code cannot read, such as a perfect submission),
// without waiting (a named pipe would block the open for ever), and read
// only if it is a regular file no larger than limit (a symlink to
// /dev/zero, or a file as large as the disk limit, would be read into
// wmrl's memory). Nil and no error: none written.
func readSubmission(dir, name string, limit int64) ([]byte, error) {
	root, err := os.OpenRoot(dir)
	if err != nil {
		return nil, fmt.Errorf("%s: the code's directory: %w", name, err)
	}
	defer root.Close()
	f, err := root.OpenFile(name, os.O_RDONLY|syscall.O_NONBLOCK|syscall.O_NOCTTY, 0)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		var pe *fs.PathError
		if errors.As(err, &pe) {
			err = pe.Err // the path is the name
		}
		return nil, fmt.Errorf("%s cannot be read in the code's directory: %w", name, err)
	}
	defer f.Close()
	fi, err := f.Stat()
	switch {
	case err != nil:
		return nil, fmt.Errorf("%s: %w", name, err)
	case !fi.Mode().IsRegular():
		return nil, fmt.Errorf("%s is not a file but a %s", name, fileKind(fi.Mode()))
	case fi.Size() > limit:
		return nil, overLimit(name, fi.Size(), limit)
	}
	b, err := io.ReadAll(io.LimitReader(f, limit+1))
	switch {
	case err != nil:
		return nil, fmt.Errorf("%s: %w", name, err)
	case int64(len(b)) > limit: // it grew: something the code left still writes
		return nil, fmt.Errorf("%s grew past the %d MiB a submission may be as it was read", name, limit>>20)
	}
	return b, nil
}

// overLimit says that the submission name is size bytes, over limit.
func overLimit(name string, size, limit int64) error {
	return fmt.Errorf("%s is %d MiB, over the %d MiB a submission may be", name, size>>20, limit>>20)
}

// fileKind names a file's type that is not a regular file's.
func fileKind(m fs.FileMode) string {
	switch {
	case m&fs.ModeDir != 0:
		return "directory"
	case m&fs.ModeNamedPipe != 0:
		return "named pipe"
	case m&fs.ModeSocket != 0:
		return "socket"
	case m&fs.ModeDevice != 0:
		return "device"
	}
	return m.Type().String()
}
