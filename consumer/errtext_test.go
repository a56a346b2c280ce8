package consumer

import "testing"

// The errors of one message's handling are unexported (no call returns them), but their texts
// are what operators read and match: they start a dead letter's Txoutbox-Dead-Error, a log
// line's err and a process span's status. They are the texts the exported sentinels had.
func TestHandlingErrorTextsAreStable(t *testing.T) {
	t.Parallel()
	for err, want := range map[error]string{
		errTxAborted:           "consumer: the handler returned nil but its transaction is aborted",
		errHandlerPanic:        "consumer: handler panicked",
		errDeliveriesExhausted: "consumer: deliveries exhausted",
		errOutOfOrder:          "consumer: message arrived after its key moved past it",
		errBatchIndex:          "consumer: BatchError names no message of the batch",
		errMalformed:           "consumer: malformed message",
	} {
		if err.Error() != want {
			t.Errorf("%q, want %q", err.Error(), want)
		}
	}
}
