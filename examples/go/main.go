// Command publish publishes one email job to postie, or many with pipelined
// publisher confirms (see "The message contract" and "Publishing many jobs" in the
// README).
//
//	cd examples/go
//	go mod tidy   # once: fetches amqp091-go and writes go.sum
//	go run . -to alice@example.com -delay-ms 10000
//
// Every setting is a flag, or else an environment variable, or else a default:
//
//	-amqp-url  AMQP_URL        amqp://guest:guest@127.0.0.1:5672/%2f
//	-prefix    POSTIE_PREFIX   postie   (publishes to exchange "<prefix>.delayed")
//	-key       EMAIL_KEY       demo-<unix ms>:welcome
//	-to        EMAIL_TO        alice@example.com
//	-delay-ms  EMAIL_DELAY_MS  5000     (0 = send now)
//	-count     EMAIL_COUNT     1        (more: keys "<key>-0", "<key>-1", ...)
//	-window    EMAIL_WINDOW    256      (publishes awaiting their confirm, at most)
//
// On success it prints one line per job, "published key=<key> exchange=<x>
// delay_ms=<n>", once the broker has confirmed it; with -count above 1, then
// "published N jobs in S s (R jobs/s, window W)". Any failure (a nack, a closed
// channel, no confirm within 30 s) exits non-zero.
//
// "go run . events [flags]" consumes postie's delivery events instead (events.go);
// "go run . outbox [flags]" enqueues an order's email through postie's transactional
// outbox (outbox.go).
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"strconv"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

const routingKey = "email"

type settings struct {
	amqpURL string
	prefix  string
	key     string
	to      string
	delayMs int64
	count   int
	window  int
}

func envOr(name, fallback string) string {
	if v, ok := os.LookupEnv(name); ok && v != "" {
		return v
	}
	return fallback
}

func parseSettings() (settings, error) {
	var s settings
	flag.StringVar(&s.amqpURL, "amqp-url", envOr("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2f"), "RabbitMQ URL")
	flag.StringVar(&s.prefix, "prefix", envOr("POSTIE_PREFIX", "postie"), "postie's topology prefix")
	// In a real service the key comes from your business data, e.g.
	// "order-42:order_confirmation", so that publishing the same event twice (a
	// retry, a redelivery) collides and yields one email. The time-based default
	// only lets this example run repeatedly.
	flag.StringVar(&s.key, "key", envOr("EMAIL_KEY", fmt.Sprintf("demo-%d:welcome", time.Now().UnixMilli())), "idempotency key")
	flag.StringVar(&s.to, "to", envOr("EMAIL_TO", "alice@example.com"), "recipient")
	delay := flag.String("delay-ms", envOr("EMAIL_DELAY_MS", "5000"), "delay in milliseconds (0 = now)")
	count := flag.String("count", envOr("EMAIL_COUNT", "1"), "how many jobs (keys <key>-0, <key>-1, ... if more than 1)")
	window := flag.String("window", envOr("EMAIL_WINDOW", "256"), "publishes awaiting their confirm, at most")
	flag.Parse()
	var err error
	if s.count, err = strconv.Atoi(*count); err != nil || s.count < 1 {
		return s, fmt.Errorf("count must be a whole number of at least 1, not %q", *count)
	}
	if s.window, err = strconv.Atoi(*window); err != nil || s.window < 1 {
		return s, fmt.Errorf("window must be a whole number of at least 1, not %q", *window)
	}
	ms, err := strconv.ParseInt(*delay, 10, 64)
	if err != nil {
		return s, fmt.Errorf("delay must be an integer number of milliseconds, not %q", *delay)
	}
	if ms < 0 {
		ms = 0
	}
	s.delayMs = ms
	return s, nil
}

// keys are the jobs' keys: the key alone, or "<key>-0" ... "<key>-<count-1>".
func (s settings) keys() []string {
	if s.count == 1 {
		return []string{s.key}
	}
	keys := make([]string, s.count)
	for i := range keys {
		keys[i] = fmt.Sprintf("%s-%d", s.key, i)
	}
	return keys
}

// confirmTimeout is how long to wait for a confirm before giving up on the broker.
const confirmTimeout = 30 * time.Second

// publish sends the jobs and calls confirmed(key) for each once the broker has
// confirmed it, in publishing order. It keeps at most s.window publishes
// unconfirmed: when the window is full it waits for the oldest confirm before
// publishing the next job. It returns at the first nack, closed channel or confirm
// timeout; jobs published but not confirmed then may or may not have arrived, and
// a real producer republishes them (the idempotency key makes that safe).
func publish(ctx context.Context, s settings, confirmed func(key string)) error {
	conn, err := amqp.Dial(s.amqpURL)
	if err != nil {
		return fmt.Errorf("connect: %w", err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return fmt.Errorf("open channel: %w", err)
	}
	defer ch.Close()

	// Publisher confirms: the broker acks (or nacks) every publish on this channel.
	if err := ch.Confirm(false); err != nil {
		return fmt.Errorf("enable publisher confirms: %w", err)
	}
	// The library hands confirms over in publishing order (an ack for several
	// publishes at once arrives as one Confirmation each). Room for a whole window, so
	// that the library never waits for us. (Not PublishWithDeferredConfirm: in
	// amqp091-go 1.5 a confirm that arrives before it returns is lost.)
	confirms := ch.NotifyPublish(make(chan amqp.Confirmation, s.window))
	closed := ch.NotifyClose(make(chan *amqp.Error, 1))

	// wait waits for the confirm of the oldest publish, key's.
	wait := func(key string) error {
		timer := time.NewTimer(confirmTimeout)
		defer timer.Stop()
		select {
		case c, ok := <-confirms:
			if !ok {
				break // the channel closed: see below
			}
			if !c.Ack {
				return fmt.Errorf("the broker nacked the publish of %s", key)
			}
			confirmed(key)
			return nil
		case <-timer.C:
			return fmt.Errorf("no confirm for %s within %v", key, confirmTimeout)
		case <-ctx.Done():
			return fmt.Errorf("no confirm for %s: %w", key, ctx.Err())
		case e := <-closed:
			if e != nil {
				return fmt.Errorf("the broker closed the channel: %w", e)
			}
		}
		// E.g. 404 when the exchange does not exist: the broker closes the channel
		// (its reason may come just after the confirms stop).
		select {
		case e := <-closed:
			if e != nil {
				return fmt.Errorf("the broker closed the channel: %w", e)
			}
		case <-time.After(time.Second):
		}
		return errors.New("the channel closed before the broker confirmed")
	}

	// Published, not yet confirmed: oldest first.
	var inFlight []string
	for _, key := range s.keys() {
		if len(inFlight) >= s.window {
			if err := wait(inFlight[0]); err != nil {
				return err
			}
			inFlight = inFlight[1:]
		}
		body, err := json.Marshal(map[string]any{
			"key":     key,
			"from":    "Shop <noreply@shop.example>",
			"to":      []string{s.to},
			"subject": "Welcome!",
			"text":    "Hello from the Go producer example.",
			"html":    "<p>Hello from the <b>Go</b> producer example.</p>",
		})
		if err != nil {
			return err
		}
		err = ch.PublishWithContext(ctx, s.prefix+".delayed", routingKey,
			false, // not mandatory: the delayed-message plugin returns every delayed
			// publish as unroutable yet delivers it later
			false,
			amqp.Publishing{
				DeliveryMode: amqp.Persistent,
				ContentType:  "application/json",
				Headers: amqp.Table{
					// int64: sent as an AMQP integer, as the contract asks.
					"x-delay": s.delayMs,
					// The due time counts from here, even if postie is down right now.
					"postie-published-at": time.Now().UnixMilli(),
				},
				Body: body,
			})
		if err != nil {
			return fmt.Errorf("publish: %w", err)
		}
		inFlight = append(inFlight, key)
	}
	for _, key := range inFlight {
		if err := wait(key); err != nil {
			return err
		}
	}
	return nil
}

func main() {
	if len(os.Args) > 1 && os.Args[1] == "events" {
		os.Exit(eventsMain(os.Args[2:]))
	}
	if len(os.Args) > 1 && os.Args[1] == "outbox" {
		os.Exit(outboxMain(os.Args[2:]))
	}
	s, err := parseSettings()
	if err != nil {
		fmt.Fprintln(os.Stderr, "publish failed:", err)
		os.Exit(2)
	}
	started := time.Now()
	err = publish(context.Background(), s, func(key string) {
		fmt.Printf("published key=%s exchange=%s.delayed delay_ms=%d\n", key, s.prefix, s.delayMs)
	})
	if err != nil {
		fmt.Fprintln(os.Stderr, "publish failed:", err)
		os.Exit(1)
	}
	if s.count > 1 {
		seconds := time.Since(started).Seconds()
		fmt.Printf("published %d jobs in %.2f s (%.0f jobs/s, window %d)\n",
			s.count, seconds, float64(s.count)/seconds, s.window)
	}
}
