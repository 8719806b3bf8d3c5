// "publish events" consumes postie's delivery events (see "Delivery events" in the
// README): a queue bound to the topic exchange "<prefix>.events", each event
// acknowledged after it was handled, duplicates (delivery is at least once) skipped
// by the event's id.
//
//	go run . events -binding 'email.dead.*'
//
// Every setting is a flag, or else an environment variable, or else a default:
//
//	-amqp-url  AMQP_URL        amqp://guest:guest@127.0.0.1:5672/%2f
//	-prefix    POSTIE_PREFIX   postie   (binds to exchange "<prefix>.events")
//	-queue     EVENTS_QUEUE    none: a temporary queue "producer.events-<pid>-<ms>",
//	                           deleted with the connection; a name: a durable quorum
//	                           queue that keeps events while this consumer is down
//	-binding   EVENTS_BINDING  email.#  (every event; "email.<outcome>.<type>")
//	-count     EVENTS_COUNT    0        (run until stopped; more: exit after that
//	                                     many distinct events)
//
// It prints "listening queue=<q> exchange=<x> binding=<b>" once bound, then one line
// per event, "event id=<id> outcome=<o> key=<k> type=<t> routing_key=<r>".
package main

import (
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"strconv"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// How many event ids are remembered for dedupe (a real consumer keeps them with its
// own data, e.g. a unique column).
const remembered = 100000

type event struct {
	ID      string  `json:"id"`
	Outcome string  `json:"outcome"`
	Key     string  `json:"key"`
	Type    *string `json:"type"`
}

func eventsMain(args []string) int {
	flags := flag.NewFlagSet("events", flag.ContinueOnError)
	amqpURL := flags.String("amqp-url", envOr("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2f"), "RabbitMQ URL")
	prefix := flags.String("prefix", envOr("POSTIE_PREFIX", "postie"), "postie's topology prefix")
	queue := flags.String("queue", envOr("EVENTS_QUEUE", ""), "a durable queue's name (default: a temporary queue)")
	binding := flags.String("binding", envOr("EVENTS_BINDING", "email.#"), "binding key")
	countText := flags.String("count", envOr("EVENTS_COUNT", "0"), "exit after this many distinct events (0: never)")
	if err := flags.Parse(args); err != nil {
		return 2
	}
	count, err := strconv.Atoi(*countText)
	if err != nil || count < 0 {
		fmt.Fprintf(os.Stderr, "events failed: count must be a whole number, not %q\n", *countText)
		return 2
	}
	if err := consumeEvents(*amqpURL, *prefix, *queue, *binding, count); err != nil {
		fmt.Fprintln(os.Stderr, "events failed:", err)
		return 1
	}
	return 0
}

func consumeEvents(amqpURL, prefix, queue, binding string, count int) error {
	conn, err := amqp.Dial(amqpURL)
	if err != nil {
		return err
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return err
	}
	exchange := prefix + ".events"
	if queue != "" {
		_, err = ch.QueueDeclare(queue, true, false, false, false, amqp.Table{"x-queue-type": "quorum"})
	} else {
		queue = fmt.Sprintf("producer.events-%d-%d", os.Getpid(), time.Now().UnixMilli())
		_, err = ch.QueueDeclare(queue, false, true, true, false, nil)
	}
	if err != nil {
		return err
	}
	if err := ch.QueueBind(queue, binding, exchange, false, nil); err != nil {
		return err
	}
	if err := ch.Qos(100, 0, false); err != nil {
		return err
	}
	deliveries, err := ch.Consume(queue, "events-example", false, false, false, false, nil)
	if err != nil {
		return err
	}
	fmt.Printf("listening queue=%s exchange=%s binding=%s\n", queue, exchange, binding)
	seen := map[string]bool{}
	var order []string
	handled := 0
	for count == 0 || handled < count {
		d, ok := <-deliveries
		if !ok {
			return errors.New("the broker ended the consumer")
		}
		var e event
		if err := json.Unmarshal(d.Body, &e); err != nil {
			return err
		}
		if !seen[e.ID] {
			seen[e.ID] = true
			order = append(order, e.ID)
			if len(order) > remembered {
				delete(seen, order[0])
				order = order[1:]
			}
			kind := "none"
			if e.Type != nil {
				kind = *e.Type
			}
			fmt.Printf("event id=%s outcome=%s key=%s type=%s routing_key=%s\n",
				e.ID, e.Outcome, e.Key, kind, d.RoutingKey)
			handled++
		}
		// Acked after it was handled: a crash before this gets it again.
		if err := d.Ack(false); err != nil {
			return err
		}
	}
	return nil
}
