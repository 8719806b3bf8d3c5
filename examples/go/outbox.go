// "publish outbox" records an order and enqueues its confirmation email in one
// transaction, through postie's transactional outbox (see "Transactional outbox" in
// the README).
//
//	postie outbox install --database postgres://app@127.0.0.1/shop   # once
//	go run . outbox -to alice@example.com -delay-ms 10000
//
// The order row and the email job commit together or not at all: postie's relay
// (outbox.sources in postie serve) publishes the job after the commit, and the
// inbox's key makes it one email. A job rolled back with the order is never sent.
//
// Every setting is a flag, or else an environment variable, or else a default:
//
//	-database-url  PRODUCER_DATABASE_URL  postgres://postgres@127.0.0.1:5432/shop
//	-order-id      ORDER_ID               <unix ms>
//	-to            EMAIL_TO               alice@example.com
//	-delay-ms      EMAIL_DELAY_MS         5000     (0 = send now)
//	-rollback                                      (roll the transaction back instead)
//
// On success it prints "enqueued key=<key> outbox_id=<id> delay_ms=<n>" after the
// commit, or with -rollback "rolled back key=<key>". Any failure exits non-zero: a
// refused job (postie.enqueue checks the key and the recipients) rolls the order back
// with it.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"strconv"
	"time"

	"github.com/jackc/pgx/v4"
)

// The shop's own table; in a real service this is your business data.
const ordersTable = `
CREATE TABLE IF NOT EXISTS example_orders (
    id         text PRIMARY KEY,
    email      text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
)`

type outboxSettings struct {
	databaseURL string
	orderID     string
	to          string
	delayMs     int64
	rollback    bool
}

func parseOutboxSettings(args []string) (outboxSettings, error) {
	var s outboxSettings
	flags := flag.NewFlagSet("outbox", flag.ContinueOnError)
	flags.StringVar(&s.databaseURL, "database-url", envOr("PRODUCER_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/shop"), "the producer's PostgreSQL")
	flags.StringVar(&s.orderID, "order-id", envOr("ORDER_ID", strconv.FormatInt(time.Now().UnixMilli(), 10)), "the order's id")
	flags.StringVar(&s.to, "to", envOr("EMAIL_TO", "alice@example.com"), "recipient")
	delay := flags.String("delay-ms", envOr("EMAIL_DELAY_MS", "5000"), "delay in milliseconds (0 = now)")
	flags.BoolVar(&s.rollback, "rollback", false, "roll the transaction back instead of committing")
	if err := flags.Parse(args); err != nil {
		return s, err
	}
	ms, err := strconv.ParseInt(*delay, 10, 64)
	if err != nil {
		return s, fmt.Errorf("delay must be an integer number of milliseconds, not %q", *delay)
	}
	s.delayMs = ms
	return s, nil
}

// enqueueOrder writes the order and its email job in one transaction and returns the
// outbox row's id.
func enqueueOrder(ctx context.Context, s outboxSettings) (string, int64, error) {
	// The email job: its key comes from the business data, so that enqueueing the
	// same event twice yields one email.
	key := fmt.Sprintf("order-%s:order_confirmation", s.orderID)
	body, err := json.Marshal(map[string]any{
		"key":     key,
		"from":    "Shop <noreply@shop.example>",
		"to":      []string{s.to},
		"subject": fmt.Sprintf("Order %s confirmed", s.orderID),
		"text":    "Hello from the Go outbox example.",
	})
	if err != nil {
		return key, 0, err
	}
	conn, err := pgx.Connect(ctx, s.databaseURL)
	if err != nil {
		return key, 0, fmt.Errorf("cannot connect: %w", err)
	}
	defer conn.Close(context.Background())
	if _, err := conn.Exec(ctx, ordersTable); err != nil {
		return key, 0, err
	}
	tx, err := conn.Begin(ctx)
	if err != nil {
		return key, 0, err
	}
	// A no-op once committed; otherwise the order and the job go together.
	defer tx.Rollback(context.Background())
	if _, err := tx.Exec(ctx, "INSERT INTO example_orders (id, email) VALUES ($1, $2)", s.orderID, s.to); err != nil {
		return key, 0, err
	}
	delayMs := s.delayMs
	if delayMs < 0 {
		delayMs = 0
	}
	// Same transaction: the job is visible to the relay only after COMMIT.
	var id int64
	err = tx.QueryRow(ctx,
		"SELECT postie.enqueue($1::jsonb, make_interval(secs => $2::bigint / 1000.0))",
		string(body), delayMs).Scan(&id)
	if err != nil {
		return key, 0, err
	}
	if s.rollback {
		return key, id, tx.Rollback(ctx)
	}
	return key, id, tx.Commit(ctx)
}

func outboxMain(args []string) int {
	s, err := parseOutboxSettings(args)
	if err != nil {
		fmt.Fprintln(os.Stderr, "outbox failed:", err)
		return 2
	}
	// One deadline for the connection and every statement.
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	key, id, err := enqueueOrder(ctx, s)
	if err != nil {
		fmt.Fprintln(os.Stderr, "outbox failed:", err)
		return 1
	}
	if s.rollback {
		fmt.Printf("rolled back key=%s\n", key)
	} else {
		fmt.Printf("enqueued key=%s outbox_id=%d delay_ms=%d\n", key, id, s.delayMs)
	}
	return 0
}
